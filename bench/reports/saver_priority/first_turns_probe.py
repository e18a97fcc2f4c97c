"""The probe behind this report's first-turn table. It sends sequential first turns against a running `kvstack serve`
(configs/local.yaml, model tiny-qwen3) with the openai SDK, and prints one JSON line.

Each request is a new random prompt of about 2,600 tokens. Nothing of it is cached, so cost_based decides RECOMPUTE,
and the replica saves its ~20 blocks to the pool. Each request streams 32 tokens (ignore_eos). The first 2 requests
are a warm-up and are not counted.

    .venv/bin/python bench/reports/saver_priority/first_turns_probe.py REQUESTS SEED
"""

import json
import random
import statistics
import sys
import time

from openai import OpenAI

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa"]


def main() -> None:
    n, seed = int(sys.argv[1]), int(sys.argv[2])
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")
    rng = random.Random(seed)
    ttft: list[float] = []
    tpot: list[float] = []
    for i in range(n + 2):
        text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(400))
        t0 = time.perf_counter()
        first = None
        tokens = 0
        stream = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": text}], max_tokens=32, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                tokens += 1
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        if i >= 2 and first is not None:
            ttft.append(first - t0)
            tpot.append((end - first) / max(1, tokens - 1))
        time.sleep(0.3)
    print(json.dumps({"n": len(ttft), "ttft_p50": statistics.median(ttft), "ttft_mean": statistics.mean(ttft),
                      "tpot_p50": statistics.median(tpot)}))


if __name__ == "__main__":
    main()
