"""Configuration names of the side-by-side benches (``bench.live_compare``, ``bench.vllm_bench_compare``,
``bench.sim_live``): one parser, so every bench reads a name the same way.

    ray_serve_llm                      Ray Serve LLM's own app over the same engine (``bench.ray_serve_llm``)
    POLICY                             ``kvstack serve --policy POLICY`` with the KV pool
    POLICY-nopool                      the same with the pool off
    NAME@KEY=VALUE[@KEY=VALUE...]      a kvstack configuration with extra ``kvstack serve --set`` overrides of its
                                       own, after the bench's common ones (e.g. ``cost_based@app.replicas.
                                       cpu_binding=unbound``: the same policy with the engines' threads unbound)

The full name (overrides included) is the configuration's label in reports. Ray Serve LLM's app takes no overrides.
"""

from __future__ import annotations

from dataclasses import dataclass

ANCHOR = "ray_serve_llm"  # Ray Serve LLM's app and prefix-affinity router over the same engine (bench.ray_serve_llm)
NO_POOL = "-nopool"  # a configuration POLICY-nopool: kvstack with that policy and the pool off


@dataclass(frozen=True)
class BenchConfig:
    name: str  # as given: the label in reports
    anchor: bool  # Ray Serve LLM's app (no kvstack policy, no pool)
    policy: str  # the kvstack policy (the anchor: "prefix_affinity", the pool-less idea it runs)
    pool: bool
    overrides: tuple[str, ...]  # KEY=VALUE for kvstack serve --set

    @property
    def kvstack(self) -> bool:
        return not self.anchor


def parse_config(name: str) -> BenchConfig:
    """``name`` read as the module docstring says; ``ValueError`` for an override without ``=`` or on the anchor."""
    base, *overrides = name.split("@")
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ValueError(f"configuration {name!r}: overrides are KEY=VALUE, got {bad}")
    if base == ANCHOR:
        if overrides:
            raise ValueError(f"configuration {name!r}: {ANCHOR} takes no kvstack overrides")
        return BenchConfig(name, True, "prefix_affinity", False, ())
    pool = not base.endswith(NO_POOL)
    return BenchConfig(name, False, base.removesuffix(NO_POOL), pool, tuple(overrides))


def check_configs(configs: list[str], serve_set: list[str]) -> None:
    """Parse every configuration and load the serve config each kvstack one would run with (the common
    ``serve_set``, then its own overrides, its policy): raises on the first that does not load, before any server
    starts."""
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides

    common = parse_overrides(serve_set)
    for name in configs:
        spec = parse_config(name)
        if spec.kvstack:
            load_serve_config(DEFAULT_CONFIG, {**common, **parse_overrides(list(spec.overrides)),
                                               "app.router.policy": spec.policy})
