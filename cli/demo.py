"""`preload demo`: greedy completion of a prompt by the bundled model."""

import time

import click

DEFAULT_PROMPT = "def fibonacci(n):\n"


@click.command()
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True, help="Text to complete.")
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(1, 1024))
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda:N.")
def demo(prompt: str, max_tokens: int, device: str) -> None:
    """Load the bundled tiny DeepSeek-V3-shaped model and complete a prompt greedily."""
    from preload import BUNDLED_MODEL, LLM

    t0 = time.perf_counter()
    llm = LLM(BUNDLED_MODEL, device=device)
    loaded = time.perf_counter() - t0
    t0 = time.perf_counter()
    [out] = llm.generate([prompt], max_tokens=max_tokens, temperature=0.0)
    took = time.perf_counter() - t0
    click.echo(f"model: bundled tiny-v3 on {llm.device} ({llm.dtype}), loaded in {loaded:.2f} s")
    click.echo("--- prompt ---")
    click.echo(prompt, nl=False)
    click.echo("\n--- greedy completion ---")
    click.echo(out.text)
    click.echo(f"--- {len(out.token_ids)} tokens in {took:.2f} s ({out.finish_reason}) ---")
