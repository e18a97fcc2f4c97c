"""E2E: ``kvstack serve`` as a subprocess — a real local Ray cluster (head + 2 workers), 2 real vLLM replicas (CPU
build), pool shards, the router — driven with the real ``openai`` SDK.

The package's one server (``conftest.py``, shared with the fault and stop modules); every test talks to it over
HTTP. Tests that need state to propagate (a replica's HBM report reaching the routers, the connector's saves
reaching the shards) poll ``/kvstack/status`` for that state with a deadline (``wait_for_status``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cluster.local_cluster import free_port
from tests.e2e.serve_run import (DTYPE, assert_fetched_as_before, get_status, hbm_blocks, pool_blocks,
                                  wait_for_status)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
MODEL = "tiny-qwen3"


def app_config() -> Any:
    """The app config ``kvstack serve`` derives from its default config and ``running_serve``'s settings (the
    replicas' engine settings, the ingress's vLLM server options)."""
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config

    return load_serve_config(DEFAULT_CONFIG, {"app.engine.model": str(REPO / ".kvstack/models/tiny-qwen3"),
                                              "app.engine.dtype": DTYPE}).app


def engine_settings() -> Any:
    return app_config().engine


def test_chat_completion_and_stream(client) -> None:
    messages = [{"role": "user", "content": "Tell me about the KV cache."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    deltas, usage = [], None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(deltas) == full.choices[0].message.content  # greedy: same tokens streamed or not
    assert usage is not None and usage.completion_tokens == 12


def test_completions_and_models(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, client) -> None:
    import openai

    url = server["base"] + "/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-3)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert "max_model_len" in str(too_long.value)  # vLLM's own message, naming the limit
    with pytest.raises(openai.BadRequestError) as unsupported:  # cannot be honoured: refused by name
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"use_beam_search": True})
    assert unsupported.value.response.json()["error"]["param"] == "use_beam_search"
    r = httpx.post(url, content=b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], '
                                b'"temperature": NaN}' % MODEL.encode(), timeout=30)
    assert r.status_code == 400 and "JSON number" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"{" + b" " * (17 * 2**20) + b"}", timeout=60)  # past the 16 MiB default limit
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=10**6,
                                       max_tokens=2)
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                        max_tokens=3, temperature=0, extra_body={"top_k": 5, "min_tokens": 3})
    assert ok.usage.completion_tokens == 3


def test_second_turn_reuses_the_prefix(server, client) -> None:
    """A long shared prefix: the second turn reuses it (HOLDER, or FETCH from the pool) and gives the same tokens."""
    system = "You are a careful assistant. " + " ".join(f"fact {i} is number {i * 7}." for i in range(120))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is fact 3?"}]
    raw_first = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                                 temperature=0)
    first = raw_first.parse()
    holder, blocks = raw_first.headers["x-kvstack-replica"], first.usage.prompt_tokens // engine_settings().block_size
    wait_for_status(server, lambda st: hbm_blocks(st).get(holder, 0) >= blocks, answers=6,
                    what=f"the HBM report of {holder} (from vLLM's KV events) holding the {blocks}-block prefix "
                         "reached both routers")
    raw_second = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                                  temperature=0)
    second = raw_second.parse()
    assert second.choices[0].message.content == first.choices[0].message.content
    # The holder is the cheapest (its HBM already has the prefix); a fetch of the same prefix onto the other
    # replica is priced within a few ms of it on this box, so both are right answers, never a recompute.
    assert raw_second.headers["x-kvstack-action"] in ("holder", "fetch")
    if raw_second.headers["x-kvstack-action"] == "holder":
        assert raw_second.headers["x-kvstack-replica"] == raw_first.headers["x-kvstack-replica"]
    assert second.usage.prompt_tokens_details.cached_tokens >= 128


def test_prefix_fetched_from_the_pool_after_hbm_reset(server, client) -> None:
    """After every replica dropped its HBM cache, the prefix comes back from a pool shard over NIXL (FETCH), and
    the tokens equal the first, recomputed answer."""
    system = "You answer briefly. " + " ".join(f"rule {i}: keep value {i * 3} safe." for i in range(110))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which rule is first?"}]
    saved_before = pool_blocks(get_status(server))
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    blocks = first.usage.prompt_tokens // engine_settings().block_size
    # The connector's saves are committed in the shards (their events follow; the routers read them every
    # poll_interval_s, a view the status does not show)...
    wait_for_status(server, lambda st: pool_blocks(st) >= saved_before + blocks,
                    what=f"the connector's saves of the {blocks}-block prompt committed in the pool")
    reset = httpx.post(server["base"][:-3] + "/kvstack/admin/reset_prefix_cache", timeout=60).json()
    assert len(reset) == 2 and all(r["ok"] for r in reset), reset
    # ...and both routers saw every replica's HBM emptied, so only the pool still holds the prefix.
    wait_for_status(server, lambda st: all(n == 0 for n in hbm_blocks(st).values()), answers=6,
                    what="both routers saw the replicas' HBM reset")
    assert_fetched_as_before(client, MODEL, messages, first)
    # The replica reports the fetch's timing (lease + NIXL read) and the routers feed it to their tier fits.
    deadline = time.monotonic() + 20
    observed = 0
    while time.monotonic() < deadline and observed == 0:
        time.sleep(1.0)
        tiers = httpx.get(server["base"][:-3] + "/kvstack/status", timeout=60).json()["tiers"]
        observed = sum(t["observed"] for t in tiers)
    assert observed >= 1, f"no pool fetch timing reached the router: {tiers}"


def test_a_holder_decided_on_a_stale_view_still_reuses_the_prefix_from_the_pool(server, client) -> None:
    """The routers see a replica's HBM through its reports (every 0.5 s): a request sent right after the replicas
    dropped their HBM may still be decided HOLDER on the old view. Its connector then finds vLLM's cache short of
    the prefix the HOLDER counted on and loads it from the pool (counted in ``holders_short``), instead of the full
    recompute such a request got before. Whatever the routers decided, the prefix is reused and the tokens equal
    the first answer's."""
    system = "You answer in one word. " + " ".join(f"item {i} weighs {i * 5} grams." for i in range(120))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which item is lightest?"}]
    saved_before = pool_blocks(get_status(server))
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6,
                                                           temperature=0)
    first, holder = raw.parse(), raw.headers["x-kvstack-replica"]
    blocks = first.usage.prompt_tokens // engine_settings().block_size
    wait_for_status(server, lambda st: pool_blocks(st) >= saved_before + blocks and hbm_blocks(st)[holder] >= blocks,
                    answers=6, what=f"the {blocks}-block prompt saved in the pool and held in HBM")
    reset = httpx.post(server["base"][:-3] + "/kvstack/admin/reset_prefix_cache", timeout=60).json()
    assert all(r["ok"] for r in reset), reset
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6,
                                                           temperature=0)  # at once: the view may be stale
    again = raw.parse()
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= (blocks - 1) * 128, raw.headers["x-kvstack-action"]
    if raw.headers["x-kvstack-action"] == "holder":  # the stale case: the connector saw it and fetched
        from prometheus_client.parser import text_string_to_metric_families

        deadline, short = time.monotonic() + 30, 0.0  # the engines' connector stats reach /metrics every few s
        while short < 1 and time.monotonic() < deadline:
            body = httpx.get(server["base"][:-3] + "/metrics", timeout=60).text
            short = sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
                        if s.name == "vllm:kvpool_scheduler_holders_short_total")
            time.sleep(1.0)
        assert short >= 1


_SPLIT_SCRIPT = """
import json, sys
import ray
from ray import serve
from deployments.app import REPLICA_DEPLOYMENT
from vllm import SamplingParams
from router.wire import ControlRequest, FetchPlanMsg, GenerateRequest, encode_sampling_params
args = json.loads(sys.argv[1])
ray.init(address=args["address"], namespace="kvstack", logging_level="ERROR", log_to_driver=False)
handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name="kvstack")
req = GenerateRequest(request_id="split-e2e", prompt_token_ids=args["tokens"],
    sampling_params=encode_sampling_params(SamplingParams(max_tokens=8, temperature=0.0)),
    target_replica=args["target"], action="split", fetch_plan=FetchPlanMsg(*args["plan"]))
text, cached, ran_on = "", 0, set()
for chunk in handle.options(stream=True).generate.remote(req):
    text += chunk.text
    cached = max(cached, chunk.cached_tokens)
    ran_on.add(chunk.replica_id)
info = handle.control.remote(ControlRequest(target_replica=args["target"], op="info")).result(timeout_s=60)
print(json.dumps({"text": text, "cached": cached, "ran_on": sorted(ran_on), "split": info["split"]}))
"""


def test_split_plan_computes_the_head_and_loads_the_staged_tail(server, client) -> None:
    """A SPLIT plan sent to the replica on the other node (straight through a Serve handle, as the ingress does):
    the replica computes the head, its node's shard pulls the tail from the shard that holds it, the request loads
    the tail on top of the cached head; the tokens equal a recomputation."""
    import random

    rng = random.Random(7)
    tokens = [rng.randrange(100, 3000) for _ in range(128 * 6 + 37)]  # 6 full blocks of 128
    before = get_status(server)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=tokens, max_tokens=8, temperature=0)
    first = raw.parse()
    computed_on = raw.headers["x-kvstack-replica"]
    nodes = {r["replica_id"]: r["node_id"] for r in before["replicas"]}
    source_node = nodes[computed_on]
    wait_for_status(server, lambda st: pool_blocks(st, source_node) >= pool_blocks(before, source_node) + 6,
                    what=f"the connector's saves of the 6 full blocks committed in the shard of node {source_node}")
    reset = httpx.post(server["base"][:-3] + "/kvstack/admin/reset_prefix_cache", timeout=60).json()
    assert all(r["ok"] for r in reset), reset
    source = next(s for s in get_status(server)["shards"] if s["node_id"] == source_node)
    target = next((rid for rid, node in nodes.items() if node != source_node), computed_on)
    args = {"address": json.loads(server["state"].read_text())["ray_address"], "tokens": tokens, "target": target,
            "plan": [source["shard_id"], source_node, "dram", 2, 6]}
    out = subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT, json.dumps(args)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ran_on"] == [target]
    assert got["text"] == first.choices[0].text
    assert got["cached"] >= 6 * 128, got  # head from the prefix cache + tail loaded: the whole prefix reused
    split = got["split"]
    # (the router may also have chosen SPLIT for other tests' requests on this replica: counts are cumulative)
    assert split["splits"] >= 1 and split["heads_computed"] == split["splits"] and split["failures"] == 0, split
    if nodes[target] != source_node:
        assert split["blocks_pulled"] >= 4, split  # blocks [2, 6) staged on the target's node


def test_two_routers_do_not_herd(server) -> None:
    """Fresh prompts arriving together through two routers spread over both vLLM replicas. They reach the idle
    replicas about one at a time (each router's in-flight term ends at the first token, tens of ms later), so what
    spreads them is the pricing (equal for replicas the calibration cannot tell apart) and each router's tie-break
    (the replica it chose least recently); coin flips once put 13 of 16 on one replica."""
    from bench.burst_spread import burst, round_summary

    rows = burst(server["base"], MODEL, n=16, concurrency=8)
    assert all(r["status"] == 200 for r in rows), [r for r in rows if r["status"] != 200]
    assert all(r["target"] == r["replica"] for r in rows if r["target"]), f"ran elsewhere than decided: {rows}"
    assert len({r["router"] for r in rows}) == 2, "both router replicas served requests"
    spread = round_summary(rows, replicas=2)
    assert spread["fewest"] >= 4, f"requests piled onto one replica: {spread}"


def test_status_lists_nodes_replicas_shards(server) -> None:
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--state-file", str(server["state"]),
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    workers = [n for n in status["nodes"] if n["cpus"] > 0]
    assert len(workers) == 2
    assert len(status["replicas"]) == 2
    # each replica reports its engine's KV cache (its blocks × block size: the configured bytes' worth, > 0)
    assert all((r["kv_capacity_tokens"] or 0) > 0 for r in status["replicas"]), status["replicas"]
    assert len(status["shards"]) == 2
    assert sum(s["dram_blocks"] + s["ssd_blocks"] for s in status["shards"]) > 0, "the connector saved blocks"
    # Prefixes served from HBM (the second turn above) refresh their pool blocks in the replica's node shard.
    assert sum(s.get("counters", {}).get("touched", 0) for s in status["shards"]) > 0, status["shards"]
    assert status["decisions"], "recent decisions are listed"


def _process_report(pids: list[int]) -> dict[str, Any]:
    """What the OS says about these processes, their descendants and every vLLM / Serve replica process on the
    machine: the evidence a failed placement check needs (name, parent, affinity, the first words of the command)."""
    def row(proc: psutil.Process) -> Any:
        try:
            return {"pid": proc.pid, "ppid": proc.ppid(), "name": proc.name(), "affinity": proc.cpu_affinity(),
                    "cmd": proc.cmdline()[:3]}
        except psutil.Error as exc:
            return {"pid": proc.pid, "error": repr(exc)}

    report: dict[str, Any] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            report[str(pid)] = [row(proc)] + [row(c) for c in proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            report[str(pid)] = "gone"
    report["vllm"] = [row(p) for p in psutil.process_iter(["name"])
                      if (p.info["name"] or "").startswith(("VLLM", "ray::Serve"))]
    return report


def test_replicas_run_on_cores_of_their_own(server) -> None:
    """The start-up output and the status name each replica's engine cores; two replicas never share one; and each
    replica's engine worker processes — as they report themselves (pid, CPUs), and as the OS shows those pids from
    outside — run on exactly those cores, in processes of their own (an in-process engine would be unbound).
    Polled: on a loaded machine the status may briefly list a replica whose engine is still starting."""
    deadline = time.monotonic() + 180
    while True:
        status = httpx.get(server["base"][:-3] + "/kvstack/status", timeout=60).json()
        placements = {r["replica_id"]: r["placement"] for r in status["replicas"]}
        assert all(p and p["threads"] == 1 and p["binding"] == "exclusive" and p["pid"] > 0
                   for p in placements.values()), placements
        cores = [c for p in placements.values() for c in p["cores"]]
        assert len(cores) == len(set(cores)) == 2, placements
        if all(p["engine_workers"] for p in placements.values()) or time.monotonic() > deadline:
            break
        time.sleep(2)
    log = server["log"].read_text()
    evidence = _process_report([p["pid"] for p in placements.values()])
    for rid, p in placements.items():
        assert f"replica {rid} on " in log and f"bound to cpus {p['cores']}" in log
        assert p["engine_workers"], (rid, p, evidence)
        for pid, cpus in p["engine_workers"]:
            # pool on: no reserved-core accident, each worker on its replica's one core
            assert pid != p["pid"] and cpus == p["cores"], (rid, p, evidence)
            assert psutil.Process(pid).cpu_affinity() == p["cores"], (rid, p, evidence)


# Strict tools: vLLM constrains a required / named call's arguments to the tool's schema (a non-strict tool's
# arguments are any JSON value, which a random-weight model fills with anything). Enums keep them short.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}


def test_an_agent_loop_with_tools_runs_through_the_openai_sdk(client) -> None:
    """What an agent framework sends: tools without tool_choice (auto, the hermes parser), then five turns of named
    tool calls, each answered by a tool result in the history. A named choice constrains decoding, so even this
    random-weight model must return a call of that tool with JSON arguments."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather agent."},
                                      {"role": "user", "content": "Weather in Paris, then the time?"}]
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=8,
                                          temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    completed = 0
    for turn in range(5):
        name, key = (("get_weather", "city"), ("get_time", "zone"))[turn % 2]
        out = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=96, temperature=0,
            tool_choice={"type": "function", "function": {"name": name}})
        choice = out.choices[0]
        call_id, arguments = f"call_{turn}", json.dumps({key: "UTC" if key == "zone" else "Paris"})
        if choice.finish_reason == "length":
            # The grammar allows any JSON whitespace, and a random model can spend its whole budget on it: then
            # there is no complete call (and none is made up); the agent goes on with the call it wanted.
            assert not choice.message.tool_calls, out
        else:
            calls = choice.message.tool_calls
            assert calls and calls[0].function.name == name, out  # (finish_reason "stop" for a named choice)
            assert list(json.loads(calls[0].function.arguments)) == [key], out
            call_id, arguments = calls[0].id, calls[0].function.arguments
            completed += 1
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"result {turn}: sunny"})
    assert out.usage.prompt_tokens > auto.usage.prompt_tokens + 50, completed  # the history grew with the calls


def test_streamed_required_tool_call_assembles(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER], max_tokens=96,
        temperature=0, tool_choice="required", stream=True)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:  # deltas of each call, by its index
                if call.function:
                    names[call.index] = names.get(call.index, "") + (call.function.name or "")
                    args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
            finish = choice.finish_reason or finish
    # "required" allows one call or several (a random model sometimes makes two): each is the only name allowed
    assert names and set(names.values()) == {"get_weather"}, names
    if finish != "length":  # (a random model may spend the budget on the whitespace JSON allows)
        assert finish == "tool_calls"
        assert all(json.loads(a)["city"] in ("Paris", "Rome") for a in args.values()), args


def test_structured_output_follows_the_schema(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "mood"],
              "properties": {"answer": {"enum": ["yes", "no"]}, "mood": {"enum": ["calm", "busy"]}}}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the cache warm?"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}})
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"answer", "mood"} and value["answer"] in ("yes", "no") and value["mood"] in ("calm", "busy")


def test_chat_template_kwargs_reach_the_template(client) -> None:
    """Qwen3's ``enable_thinking: false`` appends an empty think block to the generation prompt."""
    messages = [{"role": "user", "content": "Plan the trip."}]
    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    direct = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert direct.usage.prompt_tokens >= thinking.usage.prompt_tokens + 2  # <think> ... </think> and newlines


def test_batched_prompts_echo_and_vllm_routes(server, client) -> None:
    out = client.completions.create(model=MODEL, prompt=["The pool holds", "A block of keys"], max_tokens=4,
                                    temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("The pool holds") and out.choices[1].text.startswith("A block of keys")
    root = server["base"][:-3]
    tok = httpx.post(root + "/tokenize", json={"model": MODEL, "prompt": "The pool holds"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = httpx.post(root + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=30).json()
    assert back["prompt"] == "The pool holds"
    chat_tok = httpx.post(root + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "add_generation_prompt": True}, timeout=30).json()
    assert chat_tok["count"] > 3
    assert httpx.get(server["base"] + f"/models/{MODEL}", timeout=30).json()["id"] == MODEL
    missing = httpx.get(server["base"] + "/models/nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(root + "/version", timeout=30).json()["version"]
    emb = httpx.post(server["base"] + "/embeddings", json={"model": MODEL, "input": "x"}, timeout=30)
    assert emb.status_code == 404 and "embeddings" in emb.json()["error"]["message"]


def test_a_client_that_disconnects_mid_stream_aborts_its_engine_request(server) -> None:
    """The engine request of a stream the client drops is aborted on its replica: the replicas' running count
    (their reports, as the routers see them) is back to zero within seconds, long before 1,500 tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count forever."}], "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server["base"] + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen >= 5:
                    break  # leaving both blocks closes the connection mid-stream
    started = time.monotonic()
    wait_for_status(server, lambda st: sum(x["running"] + x["waiting"] + (x["kv_held_tokens"] or 0)
                                           for x in st["replicas"]) == 0,
                    "no request (and no KV it held) left on the replicas after the client left", answers=6,
                    timeout_s=20)
    assert time.monotonic() - started < 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """Plain vLLM's own server on the replicas' engine settings with one bound engine thread like each replica
    (``bench.oracle.ReferenceServer``): the oracle of the outputs test and of the soak's spot check, started once
    (idle while the soak loads the server; every comparison empties its prefix cache first)."""
    from bench.oracle import ReferenceServer

    app = app_config()
    ref = ReferenceServer({**app.engine.vllm_engine_kwargs(), **app.ingress.openai.vllm_serve_kwargs()}, [0],
                          tmp_path_factory.mktemp("reference") / "reference.log", free_port())
    try:
        ref.wait_ready()
        yield ref
    finally:
        ref.stop()


def test_outputs_equal_plain_vllm_with_the_same_placement(server, reference) -> None:
    """The outside oracle (``bench.oracle``): fixed multi-turn sessions through kvstack with the pool on (every
    replica's HBM emptied after each round, so revisits are served from the pool), each response judged against
    plain vLLM's own server on the same engine settings with one bound engine thread like each replica — with
    its prefix cache empty, and holding exactly the prefix kvstack reused. No unexplained difference."""
    from bench.oracle import compare

    ref = reference
    result = compare(server["base"], ref.base, MODEL, sessions=6, turns=3, reset_hbm=True, seed=11,
                     max_prompt_tokens=engine_settings().max_model_len)
    # Tool calling judged against vLLM's own server with the same tool parser: a named (strict) call and an
    # auto one, greedy, give the same message (content, tool calls) and finish reason.
    calls = []
    for i, choice in enumerate(({"type": "function", "function": {"name": "get_time"}}, None)):
        # a system message of its own heads each prompt: no prefix of it is cached anywhere, so both servers
        # compute it whole (a reused prefix may change bf16 results, which the oracle above explains)
        body = {"model": MODEL, "messages": [{"role": "system", "content": f"Parity check {i}: tools."},
                                             {"role": "user", "content": "What time is it in Berlin?"}],
                "tools": [WEATHER, CLOCK], "max_tokens": 64, "temperature": 0,
                **({"tool_choice": choice} if choice else {})}
        got = [httpx.post(base + "/chat/completions", json=body, timeout=120).json()["choices"][0]
               for base in (server["base"], ref.base + "/v1")]
        calls.append([(c["finish_reason"], c["message"].get("content"),
                       [(t["function"]["name"], t["function"]["arguments"])
                        for t in c["message"].get("tool_calls") or []]) for c in got])
    for kvstack_says, vllm_says in calls:
        assert kvstack_says == vllm_says
    assert result["unexplained"] == 0, [
        {k: c[k] for k in ("session", "turn", "action", "verdict", "prompt_tokens", "cached_tokens",
                           "reference_cached_tokens", "reference_session_cached_tokens")}
        for c in result["unexplained_cases"]]
    assert result["compared"] >= 15, result["verdicts"]
    assert result["reused_requests"] >= 8, result["by_action"]  # revisits reused their prefix (pool, or HBM)
    assert "fetch" in result["by_action"], result["by_action"]
    assert all(p.get("threads") == 1 for p in result["placement"]["kvstack"]), result["placement"]


def test_a_40_second_soak_leaves_no_lease_no_error_no_wrong_output(server, reference, tmp_path) -> None:
    """``kvstack bench soak``'s CI version (``bench.soak.soak``): 40 s of agent sessions with tools, 8 in flight,
    against this server; then its pool holds blocks and no live lease, no request failed, the engines' step times
    were measured, every process of the server was measured at start and end, and a spot check through the pool as
    the soak left it matches plain vLLM."""
    import argparse

    from bench.soak import configure, soak

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--duration-s", "40", "--in-flight", "8", "--spot-sessions", "2",
                              "--rss-interval-s", "5",
                              "--serve-set", f"app.engine.model={REPO / '.kvstack/models/tiny-qwen3'}",
                              "--serve-set", f"app.engine.dtype={DTYPE}"])
    result = soak(server["base"], server["proc"].pid, args, tmp_path, reference)
    assert result["requests"]["ok"] >= 20 and result["requests"]["errors"] == 0, result["errors"]
    assert result["pool_end"]["leases"] == 0 and result["pool_end"]["blocks"] > 0, result["pool_end"]
    assert result["step_s"]["samples"] > 100 and 0 < result["step_s"]["p50"] <= result["step_s"]["p99"]
    assert result["rss"]["total_end_mib"] > 0 and result["rss"]["gone"] == 0, result["rss"]
    during = result["rss"]["during_load"]  # sampled every 5 s: the start, 5 or more on the way, the end
    assert len(during["series"]) >= 6 and during["processes"] and all(x["total_mib"] > 0 for x in during["series"])
    assert result["wrong_outputs"] == 0 and result["spot_check"]["compared"] >= 3, result["spot_check"]
    assert result["ok"] and (tmp_path / "soak.png").exists()
