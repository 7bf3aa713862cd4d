"""preload: DeepSeek-family MoE weights loaded once, engines attached zero-copy."""

from preload.options import BUNDLED_MODEL, version


def __getattr__(name: str):
    # Import lazily: `preload --help` and the daemon's zygote should not pay for
    # the engine's imports until they need them (nor the daemon for the version lookup).
    if name == "__version__":
        return version()
    if name == "LLM":
        from preload.worker.llm import LLM

        return LLM
    if name == "attach":
        from preload.worker.attach import attach

        return attach
    raise AttributeError(name)


__all__ = ["BUNDLED_MODEL", "LLM", "attach", "__version__"]
