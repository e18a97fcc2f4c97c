"""``kvstack bench oracle``: kvstack's greedy outputs judged against plain vLLM's — an oracle that is not kvstack.

What one run does:
1. Starts plain vLLM's own OpenAI server (``vllm serve``: no KV connector, prefix caching on, vLLM's own chat
   rendering) on the same model with the same engine arguments as the kvstack config
   (``EngineSettings.vllm_engine_kwargs``), its engine threads bound like one kvstack replica's: the same thread
   count, one core each (``VLLM_CPU_OMP_THREADS_BIND``). Or it uses ``--reference URL``, a server you started.
2. Runs agent-like sessions against kvstack (``--endpoint``) with the real ``openai`` SDK: a distinct system
   prompt each (random lengths, below / at / above block boundaries), ``--turns`` turns, each turn sending the
   whole history plus a new user message; greedy, ``--max-tokens`` tokens. Turns go round-robin over sessions
   (``--concurrency`` requests at a time), so a small KV cache evicts; ``--reset-hbm`` empties every replica's
   HBM prefix cache after each round, so revisits must come from the pool.
3. Then, with kvstack idle (the reference never competes with it for the cores), for every kvstack response that
   reused ``c`` prompt tokens (``cached_tokens``: from HBM, the pool, a SPLIT), asks the reference the same request (a) with its prefix cache empty and (b) with exactly the first ``c``
   prompt tokens in its prefix cache (reset, then a 1-token completion of those tokens). The only legitimate
   source of a difference is the compute split, and (b) has the same split:
   - ``equal``: kvstack = (a) = (b);
   - ``split_explained``: kvstack = (b) ≠ (a) — plain vLLM differs the same way for the same split;
   - ``session_explained``: kvstack ≠ (b), but = (c) plain vLLM serving the session's turns in order, its own
     prefix cache holding the blocks its earlier turns computed (replayed with one output token per earlier turn —
     the prompts' full blocks, as the pool holds them — and with the full answers, as a replica's HBM holds
     them). The reused blocks were computed by an earlier request of the session, a prefill of another length
     than ``c``; its GEMMs round bf16 differently than a prefill of exactly ``c`` tokens, so (b) is not the same
     computation — (c) is;
   - ``mismatch``: kvstack ≠ (b) and ≠ (c) — unexplained; also ``prompt_differs`` (kvstack's prompt length ≠
     vLLM's rendering of the same messages) and ``reference_missed`` (the reference did not reuse exactly ``c``
     and its session replay did not match either).

``--against FILE`` judges instead by equality with an earlier run's ``--out`` of the same sessions (kvstack with
the pool on against kvstack with it off, say).

Output (``--json``: one JSON document on stdout): ``compared``, ``verdicts``, per action (``x-kvstack-action``)
the verdict counts, the placement of every kvstack replica (``/kvstack/status``) and of the reference, every
unexplained case in full, and with ``--out`` every request's texts. Exit 0 when nothing is unexplained, 1 else.
Who calls it: operators and ``tests/e2e/shared_serve/test_serve_local.py`` (a bounded run in CI), through ``compare``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.live import replica_placement, server_root
from bench.serve_process import ServerProcess, http_ok
from cluster.cli_output import print_document

REFERENCE_READY_DEADLINE_S = 300.0
REFERENCE_STOP_DEADLINE_S = 30.0
UNEXPLAINED = ("mismatch", "prompt_differs", "reference_missed", "not_in_earlier_run")
_WORDS = ("cache", "block", "token", "shard", "router", "replica", "prefix", "tensor", "layer", "node", "fetch",
          "agent", "tool", "vector", "kernel", "batch", "queue", "lease", "commit", "stream", "model", "weight")


@dataclass
class Turn:
    session: int
    turn: int
    action: str = ""
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    reference_prompt_tokens: int = 0
    reference_cached_tokens: int = 0
    reference_primed_text: str = ""
    reference_fresh_text: str = ""
    reference_session_text: str = ""
    reference_session_cached_tokens: int = 0
    verdict: str = ""


@dataclass
class Session:
    system: str
    users: list[str]
    history: list[dict[str, str]] = field(default_factory=list)


def make_sessions(n: int, turns: int, seed: int, max_system_words: int = 700) -> list[Session]:
    """Seeded sessions: system prompts of 20..``max_system_words`` words (a word is about 3 tokens of the tiny
    models' tokenizer), user messages of 3..60 words."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(k))

    return [Session(system=f"Session {i}. " + words(rng.randint(20, max_system_words)),
                    users=[words(rng.randint(3, 60)) for _ in range(turns)]) for i in range(n)]


# ------------------------------------------------------------------------------------------------ the reference
def reference_command(engine_kwargs: dict[str, Any], port: int) -> list[str]:
    """vLLM's own OpenAI server (what ``vllm serve`` runs) for these engine arguments (and server options, e.g.
    ``OpenAIFrontendSettings.vllm_serve_kwargs``: the tool parser), through its Python entry point: the CPU build's
    dist is not named ``vllm``, so the ``vllm`` CLI cannot find its own version."""
    from router.vllm_args import cli_args

    cmd = [sys.executable, "-c", "from vllm.entrypoints.launchers.api_server.entry import main; main()",
           "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details"]
    cmd += cli_args(engine_kwargs)
    return cmd


class ReferenceServer:
    """Plain vLLM's OpenAI server in a subprocess (``bench.serve_process``), bound to ``cores`` (one engine thread
    per core)."""

    def __init__(self, engine_kwargs: dict[str, Any], cores: list[int], log_path: Path, port: int) -> None:
        self.cores, self.port, self.log_path = cores, port, log_path
        from deployments.cpu_placement import engine_environment
        from router.hub import ReplicaPlacement

        self.binding = engine_environment(ReplicaPlacement(cores=cores, threads=len(cores), binding="reference"),
                                          gpu=False)  # bound exactly as a replica's engine is
        env = {**os.environ, **self.binding, "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        # Lowest priority: the reference shares cores with the kvstack replicas under test (Ray runs those at
        # nice 15), and vLLM's worker spins for a second after each request; timing never changes its outputs.
        self.process = ServerProcess("vllm serve", reference_command(engine_kwargs, port), log_path, env=env, nice=19)
        self.process.start()
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, deadline_s: float = REFERENCE_READY_DEADLINE_S) -> None:
        self.process.wait_ready(http_ok(self.base + "/health"), deadline_s)

    def placement(self) -> dict[str, Any]:
        return {"cores": self.cores, "threads": len(self.cores),
                "binding": " ".join(f"{k}={v}" for k, v in sorted(self.binding.items()))}

    def stop(self) -> None:
        self.process.stop(REFERENCE_STOP_DEADLINE_S)


# vLLM's server (uvicorn) and Ray Serve's proxy close an idle keep-alive connection after 5 s; a client that reuses it
# just then gets "connection reset" on a request the server never saw (seen in CI). Idle connections older than this
# are not reused.
KEEPALIVE_EXPIRY_S = 2.0


def http_client(timeout_s: float) -> httpx.Client:
    """An HTTP client that never reuses a connection the server may be closing (``KEEPALIVE_EXPIRY_S``)."""
    return httpx.Client(timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))


class Reference:
    """The reference's calls: tokenize (vLLM's chat rendering), reset its prefix cache, prime, chat."""

    def __init__(self, base: str, model: str, timeout_s: float = 120.0) -> None:
        import openai

        self.base, self.model = base.rstrip("/"), model
        self.http = http_client(timeout_s)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", timeout=timeout_s, max_retries=0,
                                    http_client=http_client(timeout_s))

    def tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        r = self.http.post(self.base + "/tokenize", json={"model": self.model, "messages": messages,
                                                          "add_generation_prompt": True})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def reset(self) -> None:
        self.http.post(self.base + "/reset_prefix_cache").raise_for_status()

    def prime(self, token_ids: list[int]) -> None:
        """Exactly these tokens into the prefix cache (full blocks of them; callers pass whole blocks)."""
        self.client.completions.create(model=self.model, prompt=token_ids, max_tokens=1, temperature=0)

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, int]:
        out = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0)
        details = out.usage.prompt_tokens_details
        return out.choices[0].message.content or "", out.usage.prompt_tokens, (details.cached_tokens or 0
                                                                               if details else 0)


# ------------------------------------------------------------------------------------------------ the comparison
def _kvstack_chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=max_tokens,
                                                           temperature=0)
    out = raw.parse()
    details = out.usage.prompt_tokens_details
    return {"text": out.choices[0].message.content or "", "prompt_tokens": out.usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details else 0,
            "action": raw.headers.get("x-kvstack-action", ""), "replica": raw.headers.get("x-kvstack-replica", "")}


def judge(turn: Turn, ref: Reference, messages: list[dict[str, str]], max_tokens: int,
          earlier: list[list[dict[str, str]]] = ()) -> None:
    """Fill the reference fields and the verdict of one kvstack response (see the module docstring); ``earlier``:
    the messages of the session's previous turns, in order (for the session replay)."""
    ids = ref.tokenize(messages)
    turn.reference_prompt_tokens = len(ids)
    if len(ids) != turn.prompt_tokens:
        turn.verdict = "prompt_differs"
        return
    ref.reset()
    turn.reference_fresh_text, _, fresh_cached = ref.chat(messages, max_tokens)
    if turn.cached_tokens > 0:
        ref.reset()
        ref.prime(ids[:turn.cached_tokens])
        turn.reference_primed_text, _, turn.reference_cached_tokens = ref.chat(messages, max_tokens)
    else:
        turn.reference_primed_text, turn.reference_cached_tokens = turn.reference_fresh_text, fresh_cached
    if turn.text == turn.reference_primed_text and turn.reference_cached_tokens == turn.cached_tokens:
        turn.verdict = "equal" if turn.text == turn.reference_fresh_text else "split_explained"
        return
    # The reused blocks were computed by earlier requests of the session — prefills of other lengths, whose GEMMs
    # round differently than a prefill of exactly the reused tokens. Plain vLLM serving the same session in order
    # holds blocks computed just so in its own prefix cache: its answer is the one to match. Replayed twice: with
    # one output token per earlier turn, its cache holds the prompts' full blocks only — what the pool holds (the
    # connector saves a prompt's full blocks after its prefill); with the full answers, it also holds the blocks
    # decoding completed — what a replica's HBM holds.
    for replay_tokens in (1, max_tokens):
        ref.reset()
        for msgs in earlier:
            ref.chat(msgs, replay_tokens)
        turn.reference_session_text, _, turn.reference_session_cached_tokens = ref.chat(messages, max_tokens)
        if turn.text == turn.reference_session_text:
            turn.verdict = "session_explained"
            return
    turn.verdict = "reference_missed" if turn.reference_cached_tokens != turn.cached_tokens else "mismatch"


def compare(endpoint: str, reference: str, model: str, *, sessions: int, turns: int, max_tokens: int = 8,
            concurrency: int = 1, reset_hbm: bool = False, seed: int = 0, max_prompt_tokens: int = 4000,
            max_system_words: int = 700, timeout_s: float = 120.0,
            against: dict[tuple[int, int], str] | None = None) -> dict[str, Any]:
    """Run the sessions against kvstack (``endpoint``: its ``.../v1`` base) and judge every response against the
    plain vLLM server at ``reference``; the result document (see the module docstring). With ``against`` (the
    texts of an earlier run of the same sessions by (session, turn), e.g. with the pool off), each response is
    judged by equality with that run's instead (the reference server only renders prompts then)."""
    import openai

    client = openai.OpenAI(base_url=endpoint, api_key="unused", timeout=timeout_s, max_retries=0,
                           http_client=http_client(timeout_s))
    ref = Reference(reference, model, timeout_s)
    base = server_root(endpoint)
    plan = make_sessions(sessions, turns, seed, max_system_words)
    for s in plan:
        s.history = [{"role": "system", "content": s.system}]
    # Phase 1: every session's turns through kvstack (the history grows with kvstack's own answers). Phase 2: the
    # reference judges each request, with kvstack idle — the two never compete for the cores.
    sent: list[tuple[Turn, list[dict[str, str]]]] = []
    started = time.monotonic()
    live = list(range(len(plan)))
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for t in range(turns):
            batch = []
            for i in live:
                msgs = plan[i].history + [{"role": "user", "content": plan[i].users[t]}]
                if len(ref.tokenize(msgs)) + max_tokens > max_prompt_tokens:
                    continue  # this session is done: its next turn would not fit the context
                batch.append((i, msgs))
            live = [i for i, _ in batch]
            for start in range(0, len(batch), max(1, concurrency)):
                chunk = batch[start:start + max(1, concurrency)]
                outs = list(pool.map(lambda im: _kvstack_chat(client, model, im[1], max_tokens), chunk))
                for (i, msgs), out in zip(chunk, outs, strict=True):
                    sent.append((Turn(i, t, out["action"], out["replica"], out["prompt_tokens"],
                                      out["cached_tokens"], out["text"]), msgs))
                    plan[i].history = msgs + [{"role": "assistant", "content": out["text"]}]
            if reset_hbm:
                httpx.post(base + "/kvstack/admin/reset_prefix_cache", timeout=timeout_s).raise_for_status()
                time.sleep(1.0)  # the replicas' next reports (HBM emptied) reach the routers
    kvstack_s = time.monotonic() - started
    results: list[Turn] = []
    by_session: dict[int, list[list[dict[str, str]]]] = {}
    for turn, msgs in sent:
        earlier = by_session.setdefault(turn.session, [])
        if against is None:
            judge(turn, ref, msgs, max_tokens, list(earlier))
        else:
            earlier = against.get((turn.session, turn.turn))
            text = against.get((turn.session, turn.turn))
            turn.verdict = "not_in_earlier_run" if text is None else ("equal" if text == turn.text else "mismatch")
        earlier.append(msgs)
        results.append(turn)
    verdicts = Counter(r.verdict for r in results)
    by_action: dict[str, Counter] = {}
    for r in results:
        by_action.setdefault(r.action or "?", Counter())[r.verdict] += 1
    placement = replica_placement(endpoint, timeout_s) or []
    return {
        "compared": len(results),
        "unexplained": sum(verdicts[v] for v in UNEXPLAINED),
        "verdicts": dict(verdicts),
        "by_action": {a: dict(c) for a, c in sorted(by_action.items())},
        "reused_requests": sum(1 for r in results if r.cached_tokens > 0),
        "reused_tokens": sum(r.cached_tokens for r in results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "placement": {"kvstack": placement},
        "setup": {"sessions": sessions, "turns": turns, "max_tokens": max_tokens, "concurrency": concurrency,
                  "reset_hbm": reset_hbm, "seed": seed, "endpoint": endpoint, "reference": reference},
        "wall_s": round(time.monotonic() - started, 1),
        "kvstack_s": round(kvstack_s, 1),
        "unexplained_cases": [asdict(r) for r in results if r.verdict in UNEXPLAINED],
        "requests": [asdict(r) for r in results],
    }


# ------------------------------------------------------------------------------------------------ CLI
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="http://127.0.0.1:8000/v1", help="kvstack's OpenAI base URL")
    parser.add_argument("--reference", default="", help="a running plain vLLM server (default: start one)")
    parser.add_argument("--config", type=Path, default=None, help="kvstack serve config the endpoint runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="the same --set overrides the endpoint was started with")
    parser.add_argument("--threads", type=int, default=0,
                        help="reference engine threads (default: the kvstack replicas' count, from /kvstack/status)")
    parser.add_argument("--reference-port", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-system-words", type=int, default=700,
                        help="longest system prompt (words; each session draws its length up to this)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--reset-hbm", action="store_true", help="empty the replicas' HBM after every round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against", default="",
                        help="an earlier --out file of the same sessions (e.g. pool off): judge by equality with it")
    parser.add_argument("--json", action="store_true", help="print the JSON result")
    parser.add_argument("--out", default="", help="also write the JSON result (with every request) to this file")


def replica_threads(endpoint: str) -> int:
    counts = {p.get("threads") for p in replica_placement(endpoint) or []} - {None}
    if len(counts) != 1:
        raise RuntimeError(f"the kvstack replicas report thread counts {sorted(counts)}: cannot mirror one")
    return int(counts.pop())


def run(args: argparse.Namespace) -> int:
    from cluster.local_cluster import free_port
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides

    cfg = load_serve_config(args.config or DEFAULT_CONFIG, parse_overrides(args.set))
    engine = cfg.app.engine
    server = None
    try:
        reference = args.reference
        ref_placement: dict[str, Any] = {"binding": "external", "url": reference}
        if not reference:
            threads = args.threads or replica_threads(args.endpoint)
            log_path = Path(".kvstack") / "oracle-reference.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            print(f"[oracle] starting plain vLLM ({threads} thread(s), log {log_path})", file=sys.stderr)
            server = ReferenceServer({**engine.vllm_engine_kwargs(), **cfg.app.ingress.openai.vllm_serve_kwargs()},
                                     list(range(threads)), log_path,
                                     args.reference_port or free_port())
            server.wait_ready()
            reference, ref_placement = server.base, server.placement()
        against = None
        if args.against:
            earlier = json.loads(Path(args.against).read_text())["requests"]
            against = {(r["session"], r["turn"]): r["text"] for r in earlier}
        result = compare(args.endpoint, reference, engine.served_model_name, sessions=args.sessions,
                         turns=args.turns, max_tokens=args.max_tokens, concurrency=args.concurrency,
                         reset_hbm=args.reset_hbm, seed=args.seed, max_system_words=args.max_system_words,
                         max_prompt_tokens=engine.max_model_len, against=against)
        result["setup"]["against"] = args.against or None
        result["placement"]["reference"] = ref_placement
    finally:
        if server is not None:
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k != "requests"}
    if args.json:
        print_document(json.dumps(summary))
    else:
        print(f"compared {result['compared']} requests ({result['reused_requests']} reused a prefix): "
              f"{result['verdicts']}; by action {result['by_action']}; unexplained {result['unexplained']}")
    return 0 if result["unexplained"] == 0 else 1
