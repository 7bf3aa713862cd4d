"""--api-key and CORS, as a vLLM server applies them, through real `preload serve` workers.

With a key (--api-key, else $PRELOAD_API_KEY, else $VLLM_API_KEY; the flag wins), every
/v1/* route answers 401 with an OpenAI error body unless the request carries
`Authorization: Bearer KEY`; the probes (/health, /ping, /metrics, /version) stay open,
since load balancers and scrapers hold no key. With --allowed-origins, Starlette's
CORSMiddleware sits outermost: a browser's preflight is answered (the origin echoed back)
before any key is asked for, a response to an allowed origin carries the origin (a 401
too, so that the page can read why), a disallowed origin never gets an allow-origin
header, and --allow-credentials / --allowed-methods / --allowed-headers come back exactly
as Starlette's middleware writes them. Without --allowed-origins there are no CORS headers.
The openai SDK with the right api_key is served, and with a wrong one raises
AuthenticationError.

One daemon and four workers (started together) serve the module: `keyed` (--api-key and
one allowed origin, with a different key in $VLLM_API_KEY that must lose), `cors` (two
origins, credentials, two methods, two headers; no key), and one worker keyed by each
environment variable alone.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import httpx
import openai
import pytest
from daemons import running_daemon
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from workers import spawn_worker, stop_worker, wait_healthy

KEY = "sk-test-4f1c9a"  # the keyed worker's --api-key
ENV_LOSER = "sk-from-vllm-env"  # in $VLLM_API_KEY beside --api-key: the flag wins
ENV_KEYS = {"PRELOAD_API_KEY": "sk-preload-env-77", "VLLM_API_KEY": "sk-vllm-env-88"}
ORIGIN = "http://example.com"
OTHER_ORIGIN = "http://second.example.org"
EVIL = "http://evil.example.net"
CORS_OPTIONS = {"origins": [ORIGIN, OTHER_ORIGIN], "methods": ["GET", "POST"], "headers": ["X-Custom", "Authorization"]}
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
PROBES = ("/health", "/ping", "/metrics", "/version")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict:
    out = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        out["Access-Control-Request-Headers"] = headers
    return out


def cors_headers(r: httpx.Response) -> dict[str, str]:
    """The response's access-control-* headers, by lower-case name."""
    return {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


@contextmanager
def workers_with_env(state_dir, log_dir, specs: dict[str, tuple[tuple, dict]]):
    """Workers started together, each with its options and its own API-key variables
    (neither variable is inherited from this process unless the spec sets it)."""
    with ExitStack() as stack:
        workers = {}
        for name, (options, env) in specs.items():
            with pytest.MonkeyPatch.context() as mp:
                for var in ENV_KEYS:
                    mp.delenv(var, raising=False)
                for var, value in env.items():
                    mp.setenv(var, value)
                w = spawn_worker(state_dir, log_dir / f"{name}.log", *options)
            stack.callback(stop_worker, w)
            workers[name] = w
        for w in workers.values():
            wait_healthy(w)  # (/health answers without a key: it is open)
        yield workers


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    cors = ("--allow-credentials",
            *[a for o in CORS_OPTIONS["origins"] for a in ("--allowed-origins", o)],
            *[a for m in CORS_OPTIONS["methods"] for a in ("--allowed-methods", m)],
            *[a for h in CORS_OPTIONS["headers"] for a in ("--allowed-headers", h)])
    specs = {
        "keyed": (("--api-key", KEY, "--allowed-origins", ORIGIN), {"VLLM_API_KEY": ENV_LOSER}),
        "cors": (cors, {}),
        "PRELOAD_API_KEY": ((), {"PRELOAD_API_KEY": ENV_KEYS["PRELOAD_API_KEY"]}),
        "VLLM_API_KEY": ((), {"VLLM_API_KEY": ENV_KEYS["VLLM_API_KEY"]}),
    }
    with running_daemon(tmp_path_factory.mktemp("auth-cors") / "state", model, "--dtype", "float32") as d, \
            workers_with_env(d.state_dir, tmp_path_factory.mktemp("logs"), specs) as ws:
        yield ws


@pytest.fixture(scope="module")
def keyed(workers):
    return workers["keyed"]


@pytest.fixture(scope="module")
def cors(workers):
    return workers["cors"]


@pytest.fixture(scope="module")
def name(keyed) -> str:
    r = keyed.get("/v1/models", headers=bearer(KEY))
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, f"{r.status_code}: {r.text}"
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers.get("www-authenticate") == "Bearer"
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == 401
    assert "API key" in error["message"]


# ---- the key -------------------------------------------------------------------------------


def test_v1_routes_answer_401_with_an_openai_error_body_without_the_key(keyed, name):
    assert_401(keyed.get("/v1/models"))
    assert_401(keyed.get(f"/v1/models/{name}"))
    assert_401(keyed.post("/v1/completions", COMPLETION))
    assert_401(keyed.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    assert_401(keyed.post("/v1/responses", {"input": "hi", "max_output_tokens": 2}))
    # Refused before its body is read: not even malformed JSON gets further than the key.
    assert_401(keyed.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}))


@pytest.mark.parametrize("authorization", [
    f"Bearer {KEY}x",  # a longer key
    f"Bearer {KEY[:-1]}",  # a prefix of it
    "Bearer",  # the scheme, no key
    KEY,  # the key without the scheme
    f"Basic {KEY}",
    f"Bearer {ENV_LOSER}",  # the key in $VLLM_API_KEY: --api-key wins over the environment
])
def test_a_wrong_key_is_refused_like_no_key(keyed, authorization):
    assert_401(keyed.get("/v1/models", headers={"Authorization": authorization}))
    assert_401(keyed.post("/v1/completions", COMPLETION, headers={"Authorization": authorization}))


def test_the_right_key_is_answered(keyed, name):
    r = keyed.get("/v1/models", headers=bearer(KEY))
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [name]
    r = keyed.post("/v1/completions", COMPLETION | {"model": name}, headers=bearer(KEY))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", PROBES)
def test_probes_stay_open_without_the_key(keyed, path):
    r = keyed.get(path)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:200]}"
    if path == "/metrics":
        assert "preload_" in r.text
    if path == "/version":
        assert r.json()["version"]


@pytest.mark.parametrize("var", sorted(ENV_KEYS))
def test_the_key_can_come_from_the_environment(workers, var):
    w, key = workers[var], ENV_KEYS[var]
    assert_401(w.get("/v1/models"))
    assert_401(w.post("/v1/completions", COMPLETION))
    other = ENV_KEYS["VLLM_API_KEY" if var == "PRELOAD_API_KEY" else "PRELOAD_API_KEY"]
    assert_401(w.get("/v1/models", headers=bearer(other)))
    assert w.get("/v1/models", headers=bearer(key)).status_code == 200
    r = w.post("/v1/completions", COMPLETION, headers=bearer(key))
    assert r.status_code == 200, r.text
    for path in PROBES:
        assert w.get(path).status_code == 200, path


# ---- CORS ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
def test_a_preflight_is_answered_with_the_origin_without_the_key(keyed, path):
    r = httpx.options(keyed.url + path, headers=preflight(ORIGIN, "POST", "authorization,content-type"), timeout=30)
    assert r.status_code == 200, f"{r.status_code}: {r.text}"
    h = cors_headers(r)
    assert h["access-control-allow-origin"] == ORIGIN
    assert "POST" in h["access-control-allow-methods"].split(", ")
    # Default headers: any (the requested ones mirrored), so a browser may send the key.
    assert h["access-control-allow-headers"] == "authorization,content-type"
    assert "access-control-allow-credentials" not in h  # not asked for


def test_an_allowed_origin_sees_its_answers_and_its_401s(keyed):
    r = keyed.post("/v1/completions", COMPLETION, headers={"Origin": ORIGIN} | bearer(KEY))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = keyed.post("/v1/completions", COMPLETION, headers={"Origin": ORIGIN})
    assert_401(r)
    assert r.headers["access-control-allow-origin"] == ORIGIN  # the page can read why it was refused
    assert keyed.get("/health", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN


def test_a_disallowed_origin_gets_no_allow_origin_header(keyed, cors):
    for w in (keyed, cors):
        r = httpx.options(w.url + "/v1/completions", headers=preflight(EVIL), timeout=30)
        assert r.status_code == 400 and "origin" in r.text, r.text  # (Starlette's answer)
        assert "access-control-allow-origin" not in r.headers
    r = keyed.post("/v1/completions", COMPLETION, headers={"Origin": EVIL} | bearer(KEY))
    assert r.status_code == 200  # the server answers; the browser hides it from the page
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in keyed.get("/health", headers={"Origin": EVIL}).headers


def test_credentials_methods_and_headers_are_reflected(cors):
    r = httpx.options(cors.url + "/v1/chat/completions", headers=preflight(OTHER_ORIGIN, "POST", "x-custom"),
                      timeout=30)
    assert r.status_code == 200, r.text
    h = cors_headers(r)
    assert h["access-control-allow-origin"] == OTHER_ORIGIN
    assert h["access-control-allow-credentials"] == "true"
    assert h["access-control-allow-methods"] == "GET, POST"
    allowed = h["access-control-allow-headers"].split(", ")
    assert {"X-Custom", "Authorization", "Content-Type"} <= set(allowed)
    # A method or a header not allowed: the preflight fails, naming what.
    r = httpx.options(cors.url + "/v1/models", headers=preflight(ORIGIN, "DELETE"), timeout=30)
    assert r.status_code == 400 and "method" in r.text
    r = httpx.options(cors.url + "/v1/models", headers=preflight(ORIGIN, "GET", "x-not-allowed"), timeout=30)
    assert r.status_code == 400 and "headers" in r.text
    # A simple request from an allowed origin: its origin back, with credentials.
    r = cors.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"


def oracle_app(**options) -> Starlette:
    """Starlette's CORSMiddleware on its own, configured as the worker's flags say."""

    async def ok(request):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/v1/models", ok, methods=["GET", "POST"])],
                     middleware=[Middleware(CORSMiddleware, **options)])


@pytest.mark.parametrize("worker_name, options", [
    ("keyed", {"allow_origins": [ORIGIN], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False}),
    ("cors", {"allow_origins": CORS_OPTIONS["origins"], "allow_methods": CORS_OPTIONS["methods"],
              "allow_headers": CORS_OPTIONS["headers"], "allow_credentials": True}),
])
def test_preflights_match_starlettes_cors_middleware_configured_alike(workers, worker_name, options):
    """Every preflight, allowed or not, gets the very status and access-control-* headers
    that Starlette's middleware gives with the options the flags name (their defaults: *)."""
    w = workers[worker_name]
    oracle = TestClient(oracle_app(**options))
    cases = [preflight(o, m, h) for o in (ORIGIN, OTHER_ORIGIN, EVIL) for m in ("GET", "POST", "PUT")
             for h in (None, "authorization", "x-custom,content-type", "x-other")]
    for headers in cases:
        got = httpx.options(w.url + "/v1/models", headers=headers, timeout=30)
        want = oracle.options("/v1/models", headers=headers)
        assert (got.status_code, cors_headers(got)) == (want.status_code, cors_headers(want)), headers


def test_without_allowed_origins_no_cors_headers(workers):
    w = workers["PRELOAD_API_KEY"]
    r = httpx.options(w.url + "/v1/completions", headers=preflight(ORIGIN), timeout=30)
    assert not cors_headers(r), r.headers
    assert r.status_code != 401  # a preflight is never asked for a key
    r = w.get("/v1/models", headers={"Origin": ORIGIN} | bearer(ENV_KEYS["PRELOAD_API_KEY"]))
    assert r.status_code == 200 and not cors_headers(r)


# ---- the openai SDK ------------------------------------------------------------------------


def test_the_openai_sdk_is_served_with_the_key_and_refused_with_a_wrong_one(keyed, name):
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [name]
    out = client.completions.create(model=name, prompt="def f(x):", max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model=name, prompt="def f(x):", max_tokens=2)
    assert refused.value.status_code == 401
    assert refused.value.body["type"] == "authentication_error"  # the SDK reads the OpenAI error body
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
