"""A worker's front and its engine cores (worker/front.py, worker/core.py), real processes
over the real channel: a core killed mid-stream costs its requests nothing (the slot's
next core takes them up where they were: the same greedy tokens, the same text, no piece
twice); a rolling restart's core takes them over from a live one, which retires; a
request that kills every core it meets fails alone, its neighbours served; a front that
restarts finds the slot's core again; requests whose core never comes back fail (503)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from cores import start_core

from preload import BUNDLED_MODEL, LLM
from preload.bench.checkpoint import word_level_tokenizer
from preload.worker import front as front_module
from preload.worker.core_channel import core_address
from preload.worker.engine.async_engine import EngineDead, RequestFailed
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.front import CoreClient
from preload.worker.serve import read_tokenizer

PROMPT = [5, 6, 7, 8, 9]
POISON = 777


@pytest.fixture(scope="module")
def want():
    """What an uninterrupted run gives (in this process), by prompt."""
    llm = LLM(BUNDLED_MODEL, dtype="float32")

    def of(prompt, max_tokens=40):
        return llm.generate([prompt], max_tokens=max_tokens, ignore_eos=True)[0]

    return of


@pytest.fixture
def address(tmp_path):
    return core_address(tmp_path, 0)


@pytest.fixture
def cores():
    """The cores a test starts; those still running at its end are killed (a failing test
    leaves no process behind)."""
    procs = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            kill(proc)


def greedy(prompt, max_tokens=40) -> Sequence:
    return Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def started(address: str) -> tuple[CoreClient, asyncio.Task]:
    client = CoreClient(address)
    return client, asyncio.ensure_future(client.run())


async def serving(address: str, cores: list, **core) -> tuple[CoreClient, asyncio.Task]:
    """A front on `address` and its first core (appended to `cores`), once the core said hello."""
    client, reader = await started(address)
    cores.append(await asyncio.to_thread(start_core, address, **core))
    await asyncio.wait_for(client.hello.wait(), 60)
    return client, reader


async def read(client: CoreClient, seq: Sequence, each=None) -> tuple[list[int], str, list[str]]:
    """The tokens, the text and its pieces as a client reads them; `each(tokens)` after each Output."""
    tokens, pieces = [], []
    async for out in client.submit(seq):
        tokens += out.token_ids
        pieces.append(out.text)
        if each is not None:
            await each(tokens)
    return tokens, "".join(pieces), pieces


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_core_killed_mid_stream_loses_nothing(address, want, cores):

    async def main():
        client, reader = await serving(address, cores)

        async def each(tokens):
            if len(tokens) >= 8 and len(cores) == 1:
                kill(cores[0])
                cores.append(await asyncio.to_thread(start_core, address, "died"))

        got = await read(client, greedy(PROMPT), each)
        reader.cancel()
        client.close()
        return got, client

    (tokens, text, pieces), client = asyncio.run(main())
    whole = want(PROMPT)
    assert tokens == whole.token_ids and text == whole.text
    assert client.cores_lost == 1 and len(cores) == 2


def test_a_rolling_restarts_core_takes_over_from_a_live_one(address, want, cores):

    async def main():
        client, reader = await serving(address, cores)

        async def each(tokens):
            if len(tokens) >= 8 and len(cores) == 1:
                first = client.core
                cores.append(await asyncio.to_thread(start_core, address, "restart"))
                while client.core == first:  # (its hello on the way)
                    await asyncio.sleep(0.01)
                taken_at.append(len(tokens))

        taken_at = []
        got = await read(client, greedy(PROMPT, 120), each)
        assert await asyncio.to_thread(cores[0].wait, 10) == 0  # retired by the front, it ended on its own
        reader.cancel()
        client.close()
        return got, client, taken_at

    (tokens, text, _), client, taken_at = asyncio.run(main())
    assert taken_at and taken_at[0] < 120  # (the new core computed the rest)
    assert tokens == want(PROMPT, 120).token_ids and client.cores_lost == 0


def test_a_request_finished_but_not_yet_read_is_not_taken_up_by_the_next_core(address, want, cores):
    """A rolling restart's core says hello after a request's last tokens came but before
    its reader took them (a busy event loop, a slow client): the request is done, and no
    core takes it up again. (Kept until read, it once looked like a request waiting for a
    core: the new core computed one token past max_tokens, delivered with the last ones.)"""

    async def main():
        client, reader = await serving(address, cores)
        seq = greedy(PROMPT, 8)
        stream = client.submit(seq)
        tokens = list((await stream.__anext__()).token_ids)  # (in; its reader reads nothing more for now)
        while seq.id in client.requests and client.requests[seq.id].core is not None:
            await asyncio.sleep(0.01)
        first = client.core
        cores.append(await asyncio.to_thread(start_core, address, "restart"))
        while client.core == first:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # (what the new core would compute for it comes meanwhile)
        async for out in stream:
            tokens += out.token_ids
        reader.cancel()
        client.close()
        return tokens

    assert asyncio.run(main()) == want(PROMPT, 8).token_ids


def test_a_request_that_kills_every_core_fails_alone(address, want, monkeypatch, cores):

    async def main():
        client, reader = await serving(address, cores, poison=POISON)

        async def replace_dead():
            while True:
                await asyncio.sleep(0.05)
                if cores[-1].poll() is not None:
                    cores.append(await asyncio.to_thread(start_core, address, "died", poison=POISON))

        keeper = asyncio.ensure_future(replace_dead())
        results = await asyncio.gather(read(client, greedy([1, POISON, 3])), read(client, greedy(PROMPT)),
                                       read(client, greedy([9, 8, 7], 30)), return_exceptions=True)
        keeper.cancel()
        reader.cancel()
        client.close()
        return results

    pill, first, second = asyncio.run(main())
    assert isinstance(pill, RequestFailed) and re.search(r"died [34] times", str(pill)) and "alone" in str(pill)
    assert first[0] == want(PROMPT).token_ids and second[0] == want([9, 8, 7], 30).token_ids
    assert len(cores) >= 4  # the pill killed three at least (the last with it alone); the last one serves


def test_a_request_its_core_refuses_fails_alone_with_the_cores_reason(address, want, cores):
    """An Output with an error (here the core refusing a request handed over with output
    its grammar does not allow) fails that request with the core's reason, and its
    neighbours are served."""
    from preload.worker.engine.grammar import regex_grammar

    async def main():
        client, reader = await serving(address, cores)
        bad = Sequence(list(PROMPT), SamplingParams(max_tokens=8, grammar=regex_grammar("[0-9]+")), output=[5, 6])
        results = await asyncio.gather(read(client, bad), read(client, greedy(PROMPT)), return_exceptions=True)
        reader.cancel()
        client.close()
        return results

    refused, served = asyncio.run(main())
    assert isinstance(refused, RequestFailed) and "the grammar refuses the output's token" in str(refused), refused
    assert served[0] == want(PROMPT).token_ids


def test_a_new_front_finds_the_slots_core_again(address, want, cores):
    async def main():
        client, reader = await started(address)
        cores.append(await asyncio.to_thread(start_core, address))
        await asyncio.wait_for(client.hello.wait(), 60)
        await read(client, greedy(PROMPT, 4))
        reader.cancel()
        client.close()  # the front is gone; the core lives on
        again, reader = await started(address)
        await asyncio.wait_for(again.hello.wait(), 10)  # (its beats met a front that asked for a hello)
        got = await read(again, greedy(PROMPT))
        reader.cancel()
        again.close()
        return got

    tokens, _, _ = asyncio.run(main())
    assert tokens == want(PROMPT).token_ids


def test_a_tokenizer_read_ahead_is_the_fronts_where_the_cores_hello_carries_its_files(address, want, cores,
                                                                                      tmp_path):
    """A front reads the checkpoint's tokenizer while the slot's core starts (serve.py): the
    core's hello then costs no parse where it carries the same files, and its own files serve
    where they differ (the checkpoint's changed since the daemon loaded it)."""
    other = tmp_path / "other"
    other.mkdir()
    text, config = word_level_tokenizer(300, None, 2)
    (other / "tokenizer.json").write_text(text)
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_tokenizer(None) is None and read_tokenizer(str(tmp_path / "missing")) is None

    async def main(read_ahead):
        client = CoreClient(address)
        client.read_ahead = read_ahead
        reader = asyncio.ensure_future(client.run())
        if not cores:
            cores.append(await asyncio.to_thread(start_core, address))
        await asyncio.wait_for(client.hello.wait(), 60)
        got = await read(client, greedy(PROMPT, 8))
        reader.cancel()
        client.close()
        return client.tokenizer, got

    same, different = read_tokenizer(str(BUNDLED_MODEL)), read_tokenizer(str(other))
    tokenizer, (tokens, text, _) = asyncio.run(main(same))
    assert tokenizer is same
    assert tokens == want(PROMPT, 8).token_ids and text == want(PROMPT, 8).text
    tokenizer, (tokens, text, _) = asyncio.run(main(different))  # (the same core, a front again)
    assert tokenizer is not different and tokenizer.made_of(same.files) and not tokenizer.made_of(different.files)
    assert tokens == want(PROMPT, 8).token_ids and text == want(PROMPT, 8).text


def test_requests_fail_when_no_core_comes_back(address, monkeypatch, cores):
    monkeypatch.setattr(front_module, "CORE_WAIT", 1.0)

    async def main():
        client, reader = await started(address)
        core = await asyncio.to_thread(start_core, address)
        cores.append(core)
        await asyncio.wait_for(client.hello.wait(), 60)

        async def each(tokens):
            if core.poll() is None:
                kill(core)

        try:
            return await read(client, greedy(PROMPT, 200), each)
        except EngineDead as e:
            return e
        finally:
            assert not client.alive
            reader.cancel()
            client.close()

    assert isinstance(asyncio.run(main()), EngineDead)


def test_the_channel_is_the_owners_alone(address):
    async def main():
        client, reader = await started(address)
        await asyncio.sleep(0.1)
        reader.cancel()
        client.close()

    asyncio.run(main())
    path = address.removeprefix("ipc://")
    assert not os.path.exists(path) or os.stat(path).st_mode & 0o077 == 0


def test_a_silent_core_is_not_answering_before_its_requests_give_up(address, monkeypatch, cores):
    """/health (answering) turns at CORE_SILENCE; requests are still taken (alive) until CORE_WAIT."""
    monkeypatch.setattr(front_module, "CORE_SILENCE", 0.5)
    monkeypatch.setattr(front_module, "CORE_WAIT", 3.0)

    async def main():
        client, reader = await serving(address, cores)
        assert client.answering and client.alive
        kill(cores[0])
        await asyncio.sleep(1.0)
        seen = (client.answering, client.alive)
        await asyncio.sleep(2.5)
        reader.cancel()
        client.close()
        return seen, (client.answering, client.alive)

    assert asyncio.run(main()) == ((False, True), (False, False))


QUIET_CORE = """
import os, sys, torch
from preload import BUNDLED_MODEL, LLM
from preload.worker import core as core_module
from preload.worker.core import Core, hello_of
core_module.BEAT = 60.0  # no beat on the clock while the test runs: only those the core sends early
llm = LLM(BUNDLED_MODEL, dtype="float32", device="cpu")
default = torch.get_num_threads()
core = Core(llm, sys.argv[1], hello_of(llm, "tiny", "first"), drain_timeout=5.0)
print("serving", default, torch.get_num_threads(), len(os.sched_getaffinity(0)), flush=True)
core.run()
core.close()
"""


def test_requests_dropped_together_cost_one_abort_and_the_core_says_at_once_they_are_freed(address, cores):
    """Clients that hang up together (issue 36: 500 dropped streams took seconds to free):
    their aborts reach the core in one message, and the core's next beat, at once rather
    than on the clock, says their KV blocks are free. On a CPU the core's torch threads
    leave a CPU to its front (whose work the aborts are)."""
    n = 64
    seqs = [greedy([5 + i % 50, 6, 7], 2000) for i in range(n)]

    async def main():
        client, reader = await started(address)
        proc = subprocess.Popen([sys.executable, "-c", QUIET_CORE, address], stdout=subprocess.PIPE, text=True)
        cores.append(proc)
        line = (await asyncio.to_thread(proc.stdout.readline)).split()
        assert line[:1] == ["serving"], line
        default, threads, cpus = map(int, line[1:])
        assert threads == max(1, min(default, cpus - 1)), (default, threads, cpus)
        await asyncio.wait_for(client.hello.wait(), 60)
        beats = []
        client.on_step = lambda: beats.append((time.monotonic(), client.stats()))
        sent = []
        send = client._send
        client._send = lambda core, msg: (sent.append(msg), send(core, msg))
        started_ = [asyncio.Event() for _ in range(n)]

        async def stream(i):
            async for _ in client.submit(seqs[i]):
                started_[i].set()

        tasks = [asyncio.ensure_future(stream(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started_)), 60)
        assert not any(t.done() for t in tasks)
        beats.clear()
        dropped = time.monotonic()
        for t in tasks:  # (in one turn of the loop, as a crowd of disconnects lands)
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while not beats and time.monotonic() - dropped < 5:
            await asyncio.sleep(0.005)
        reader.cancel()
        client.close()
        return [m for m in sent if m["t"] == "abort"], beats, dropped

    aborts, beats, dropped = asyncio.run(main())
    assert len(aborts) == 1 and sorted(aborts[0]["ids"]) == sorted(seq.id for seq in seqs), aborts[:3]
    assert beats, "no beat after the aborts (the core's next one on the clock is a minute away)"
    heard, stats = beats[0]
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0, stats
    assert heard - dropped < 2.0  # (~0.01-0.05 s: the step under way, then the beat)


def test_a_cores_figures_read_across_versions():
    """A front outlives a rolling restart onto new code: a beat with fields it does not
    know of (a newer core's) reads, and one without its newest (an older core's) too."""
    import dataclasses

    from preload.worker.core_channel import stats_from_wire, stats_to_wire
    from preload.worker.engine.engine import EngineStats

    s = EngineStats(1, 2, 3, 64, 0, 10, 5, 0, 0, 4096, graphs_pending=7)
    assert stats_from_wire(stats_to_wire(s)) == s
    assert stats_from_wire(stats_to_wire(s) + [123, "a field of later"]) == s
    assert stats_from_wire(stats_to_wire(s)[:10]) == dataclasses.replace(s, graphs_pending=0)
