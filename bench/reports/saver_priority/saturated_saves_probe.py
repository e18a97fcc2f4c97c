"""The probe behind this report's check under load. It runs against a running `kvstack serve` (configs/local.yaml,
model tiny-qwen3). CLIENTS threads send new random ~2,600-token prompts for SECONDS (32 streamed tokens each), which
keeps both engines busy. It then waits 8 s for the savers to drain and prints one JSON line: the request count,
the TTFT p50 and mean, and each shard's committed blocks (`/kvstack/status`).

A full save is 20 blocks a request (128-token blocks).

    .venv/bin/python bench/reports/saver_priority/saturated_saves_probe.py CLIENTS SECONDS SEED
"""

import json
import random
import statistics
import sys
import threading
import time
import urllib.request

from openai import OpenAI

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa"]


def main() -> None:
    clients, seconds, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")
    ttft: list[float] = []
    end = time.monotonic() + seconds

    def one_client(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        while time.monotonic() < end:
            text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(400))
            t0 = time.perf_counter()
            first = None
            stream = client.chat.completions.create(
                model="tiny-qwen3", messages=[{"role": "user", "content": text}], max_tokens=32, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            if first is not None:
                ttft.append(first - t0)

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(8)
    status = json.load(urllib.request.urlopen("http://127.0.0.1:8000/kvstack/status"))
    print(json.dumps({"requests": len(ttft), "ttft_p50": statistics.median(ttft), "ttft_mean": statistics.mean(ttft),
                      "committed_by_shard": {s["shard_id"]: s["counters"]["committed"] for s in status["shards"]}}))


if __name__ == "__main__":
    main()
