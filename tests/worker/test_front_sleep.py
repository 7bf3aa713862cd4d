"""A front whose slot sleeps (`preload sleep`: the daemon kills its cores and says so on
the front's link; worker/front.py, worker/link.py): /health says "sleeping"; the requests
in flight and those that come are held, none counting a failover, and after the wake the
first core's hello takes them up where they were (the same greedy tokens); a request
asleep for SLEEP_WAIT fails (503, naming sleep). Real core processes (tests/cores.py),
the front's app driven through ASGI, the daemon's end of the link a socket pair."""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import httpx
import pytest
from cores import start_core

from preload import BUNDLED_MODEL, LLM
from preload.worker import front as front_module
from preload.worker.api.app import create_app
from preload.worker.api.state import WorkerState
from preload.worker.core_channel import core_address
from preload.worker.engine.async_engine import EngineDead
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.front import CoreClient
from preload.worker.link import DaemonLink

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def want():
    """What an uninterrupted run gives (in this process), by prompt."""
    llm = LLM(BUNDLED_MODEL, dtype="float32")
    return lambda prompt, max_tokens=40: llm.generate([prompt], max_tokens=max_tokens, ignore_eos=True)[0]


@pytest.fixture
def address(tmp_path):
    return core_address(tmp_path, 0)


@pytest.fixture
def cores():
    """The cores a test starts; those still running at its end are killed."""
    procs = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            kill(proc)


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def greedy(prompt, max_tokens=40) -> Sequence:
    return Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class Slot:
    """A front (its CoreClient, its app) with its first core, and the daemon's end of its
    link, wired as serve_front wires it."""

    async def start(self, address: str, cores: list) -> Slot:
        self.address, self.cores = address, cores
        self.client = CoreClient(address)
        self.reader = asyncio.ensure_future(self.client.run())
        cores.append(await asyncio.to_thread(start_core, address))
        await asyncio.wait_for(self.client.hello.wait(), 60)
        self.daemon, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.link = DaemonLink(theirs.detach())
        loop = asyncio.get_running_loop()
        self.link.on_sleep = lambda sleeping, level: loop.call_soon_threadsafe(self.client.sleep, sleeping, level)
        self.link.listen()
        app = create_app(self.client, self.client.tokenizer, "tiny", WorkerState(phase="ready"))
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front", timeout=60)
        return self

    async def tell(self, msg: dict) -> None:
        """The daemon's word, once the front has heard it."""
        self.daemon.send(json.dumps(msg).encode())
        while self.client.asleep != msg["sleeping"]:
            await asyncio.sleep(0.01)

    async def health(self) -> tuple[int, dict]:
        r = await self.http.get("/health")
        return r.status_code, r.json()

    async def new_core(self) -> None:
        """The wake's core, as the daemon forks it (a restart's hello), once it has said hello."""
        self.cores.append(await asyncio.to_thread(start_core, self.address, "restart"))
        while self.client.core is None:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        await self.http.aclose()
        self.link.close()
        self.daemon.close()
        self.reader.cancel()
        self.client.close()


async def read(client: CoreClient, seq: Sequence, each=None) -> list[int]:
    tokens = []
    async for out in client.submit(seq):
        tokens += out.token_ids
        if each is not None:
            await each(tokens)
    return tokens


def test_the_link_hands_sleep_and_wake_to_its_callback():
    heard = []
    daemon, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = DaemonLink(theirs.detach(), on_sleep=lambda sleeping, level: heard.append((sleeping, level)))
    link.listen()
    for msg in (b'{"sleeping": true, "level": 2}', b"not json", b'{"what": 1}', b'{"sleeping": false}'):
        daemon.send(msg)
    for _ in range(500):
        if len(heard) == 2:
            break
        link._stop.wait(0.01)
    link.close()
    daemon.close()
    assert heard == [(True, 2), (False, None)]


def test_a_stream_held_through_sleep_and_wake_gets_the_uninterrupted_tokens(address, want, cores, monkeypatch):
    """The daemon kills the core, then says the slot sleeps; asleep longer than CORE_WAIT,
    the stream is held, and after the wake the new core computes the rest."""

    async def main():
        slot = await Slot().start(address, cores)
        client = slot.client
        assert await slot.health() == (200, {"status": "ready"})
        seen = {}

        async def each(tokens):
            if len(tokens) >= 8 and not seen:
                kill(cores[0])
                await slot.tell({"sleeping": True, "level": 1})
                seen["asleep"] = await slot.health()
                with monkeypatch.context() as m:
                    m.setattr(front_module, "CORE_WAIT", 0.3)  # (asleep, no core's silence fails a request)
                    await asyncio.sleep(1.0)
                    seen["held"] = [(r.core, r.failovers) for r in client.requests.values()], client.alive
                await slot.tell({"sleeping": False})
                seen["woken"] = await slot.health()
                await slot.new_core()
                seen["served"] = await slot.health()

        tokens = await read(client, greedy(PROMPT), each)
        await slot.close()
        return tokens, seen, client.cores_lost

    tokens, seen, lost = asyncio.run(main())
    assert seen["asleep"] == (503, {"status": "sleeping"})
    assert seen["held"] == ([(None, 0)], True)
    assert seen["woken"] == (503, {"status": "engine not answering"})  # (no core yet)
    assert seen["served"] == (200, {"status": "ready"})
    assert tokens == want(PROMPT).token_ids and lost == 0 and len(cores) == 2


def test_a_request_sent_while_asleep_is_served_after_the_wake(address, want, cores):
    """The daemon's word comes before the kill, this time: the live core's beats are not
    answered, nothing goes to it, and the request waits for the wake's core."""

    async def main():
        slot = await Slot().start(address, cores)
        client = slot.client
        await slot.tell({"sleeping": True, "level": 2})
        task = asyncio.ensure_future(read(client, greedy(PROMPT)))
        await asyncio.sleep(0.5)  # (the old core still beats)
        held = [r.core for r in client.requests.values()], client.core, await slot.health()
        kill(cores[0])
        await asyncio.sleep(0.3)
        assert not task.done()
        await slot.tell({"sleeping": False})
        await slot.new_core()
        tokens = await asyncio.wait_for(task, 60)
        await slot.close()
        return tokens, held, client.cores_lost

    tokens, held, lost = asyncio.run(main())
    assert held == ([None], None, (503, {"status": "sleeping"}))
    assert tokens == want(PROMPT).token_ids and lost == 0


def test_a_request_asleep_for_sleep_wait_fails_naming_sleep(address, cores, monkeypatch):
    monkeypatch.setattr(front_module, "SLEEP_WAIT", 1.0)

    async def main():
        slot = await Slot().start(address, cores)
        kill(cores[0])
        await slot.tell({"sleeping": True, "level": 1})
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        r = await slot.http.post("/v1/completions", json=body)
        try:
            await read(slot.client, greedy(PROMPT))
            direct = None
        except EngineDead as e:
            direct = e
        health = await slot.health()
        await slot.close()
        return r, direct, health

    r, direct, health = asyncio.run(main())
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert "asleep" in message and "preload wake" in message, message
    assert isinstance(direct, EngineDead) and "asleep" in str(direct)
    assert health == (503, {"status": "sleeping"})
