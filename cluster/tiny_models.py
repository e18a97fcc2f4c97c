r"""Deterministic tiny models for tests, the embedded default and the CPU benchmarks (no hub access).

Contract: ``make_tiny(spec, out_dir)`` writes a Hugging Face model directory that vLLM loads from disk:
a byte-level BPE tokenizer trained with ``tokenizers`` on a built-in corpus (Qwen-style special tokens, Qwen3's
tool/reasoning markup tokens and a ChatML chat template with tools and thinking, see below), a ``config.json`` for
``Qwen3ForCausalLM`` (dense) or ``Qwen3NextForCausalLM`` (hybrid: gated delta net + full attention, dense MLP), and
random bf16 weights saved as safetensors. A hybrid's last layer carries a small MoE (4 experts, top 2) because vLLM's
Qwen3Next requires one; the other layers use a dense MLP. Everything is seeded: the same spec gives byte-identical
files. Weights use untied embeddings and ``initializer_range`` 0.1 (tied / 0.02 weights make a random
model repeat one token forever, which makes token-equality checks meaningless). For the same reason attention is
sharpened (q/k norm gain 4) and the hybrid's gated-delta-net layers get long memory (decay rates U(0.001, 0.1)):
with HF's defaults a random hybrid's next token depends on the last few tokens only, and a random dense model's
barely on tokens a few hundred positions back, so wrong prefix KV or state would go unnoticed. Measured here:
changing one token 300-500 positions back changes the greedy continuation of (nearly) every prompt.

Tokenizer and chat template follow Qwen3, so vLLM's ``hermes`` tool-call parser and ``qwen3`` reasoning parser work
on the tiny models: ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``, ``<tool_response>`` and
``</tool_response>`` are single added tokens that are *not* special (decoding with ``skip_special_tokens=True`` keeps
them, so the parsers see them), next to the specials ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>``
(eos); the vocabulary still has exactly ``spec.vocab`` ids. ``CHAT_TEMPLATE`` (our own Jinja) renders ChatML: plain
messages exactly as ``<|im_start|>{role}\n{content}<|im_end|>\n`` each; with ``tools`` a system turn (merged with a
leading system message) lists them as JSON in ``<tools></tools>`` and asks for hermes-style
``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``; assistant ``tool_calls`` render as such blocks
after the content (which may be ``None`` or empty; dict arguments as JSON, string arguments verbatim),
``role: tool`` messages as ``<tool_response>`` blocks in one user turn per run of tool messages, and an assistant's
reasoning (``reasoning_content`` / ``reasoning`` or ``<think>...</think>`` in its content) as a ``<think>`` block
only after the last user message (earlier turns drop it, as Qwen3 does). The generation prompt is
``<|im_start|>assistant\n``, followed by an empty ``<think>\n\n</think>\n\n`` when ``enable_thinking`` is false
(default: thinking on, nothing appended).

Idempotent: the directory carries ``kvstack_tiny.json`` with the spec and its hash (the hash covers
``GENERATOR_VERSION``); when it matches, nothing is rebuilt. A directory holding something else is refused (never
silently overwritten): a foreign directory always, another tiny model (other spec, or one written by an older
generator) unless ``force`` is given; ``ensure_configured`` passes ``force`` for the latter, so a config's model is
rebuilt in place when the generator changes. Writes go to a temporary sibling directory that is renamed into place,
so a crashed build never leaves a half-written model.

Called by ``kvstack models make-tiny`` (``cluster/commands/models.py``), test fixtures and the reuse benchmark.
Heavy imports (torch, transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Arch = Literal["qwen3", "qwen3-next"]
Preset = Literal["tiny", "heavy"]
ARCHS: tuple[str, ...] = ("qwen3", "qwen3-next")
PRESETS: tuple[str, ...] = ("tiny", "heavy")
MARKER_FILE = "kvstack_tiny.json"
GENERATOR_VERSION = 2  # 2: tool-call / think / tool-response tokens and the tools + thinking chat template

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's markup tokens: single ids, not special (``skip_special_tokens`` keeps them for the tool / reasoning parsers).
MARKUP_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
)
# ChatML in Qwen3's tool / thinking format (our own text; behaviour in the module docstring). Every tag trims the
# whitespace before it, so the indentation below never reaches the prompt.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1, skip=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {%- set ns.skip = 1 %}
        {%- if messages[0].content is string and messages[0].content %}
            {{- messages[0].content + '\n\n' }}
        {%- endif %}
    {%- endif %}
    {{- '# Tools\n\nYou may call the functions described below, one JSON signature per line inside ' }}
    {{- '<tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call functions, reply with one JSON object per call, each inside ' }}
    {{- '<tool_call></tool_call>:\n' }}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.index0 >= ns.skip %}
        {%- set content = message.content if message.content is string else '' %}
        {%- if message.role == 'assistant' %}
            {%- set reasoning = '' %}
            {%- if message.reasoning_content is string %}
                {%- set reasoning = message.reasoning_content %}
            {%- elif message.reasoning is string %}
                {%- set reasoning = message.reasoning %}
            {%- elif '</think>' in content %}
                {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
            {{- '<|im_start|>assistant\n' }}
            {%- if reasoning.strip('\n') and loop.index0 > ns.last_user %}
                {%- set content = content.lstrip('\n') %}
                {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
            {%- endif %}
            {{- content }}
            {%- for call in (message.tool_calls or []) %}
                {%- set fn = call.function if call.function is mapping else call %}
                {%- set args = fn.arguments if fn.arguments is defined and fn.arguments is not none else {} %}
                {%- if content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
                {{- args if args is string else (args | tojson) }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>\n' }}
        {%- elif message.role == 'tool' %}
            {%- if loop.first or loop.previtem.role != 'tool' %}
                {{- '<|im_start|>user' }}
            {%- endif %}
            {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
            {%- if loop.last or loop.nextitem.role != 'tool' %}
                {{- '<|im_end|>\n' }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


@dataclass(frozen=True)
class TinySpec:
    """Shapes of one tiny model. ``linear_*`` fields apply to the hybrid (qwen3-next) architecture only."""

    arch: Arch
    preset: Preset = "tiny"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    vocab: int = 4096
    max_positions: int = 8192
    full_attention_interval: int = 4  # qwen3-next: every Nth layer is full attention, the rest gated delta net
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    conv_kernel: int = 4
    qk_norm_gain: float = 4.0  # q/k RMSNorm gain: > 1 sharpens attention so outputs depend on the whole context
    linear_decay_min: float = 0.001  # qwen3-next: gated-delta-net decay rates A ~ U(min, max) (small = long memory)
    linear_decay_max: float = 0.1
    moe_experts: int = 4  # qwen3-next only: experts of the one MoE layer (vLLM requires one)
    moe_top_k: int = 2
    initializer_range: float = 0.1
    seed: int = 0

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {ARCHS}")
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vocab < 512:
            raise ValueError(f"vocab must be at least 512 (256 bytes + merges + specials), got {self.vocab}")
        if self.arch == "qwen3-next":
            if self.layers % self.full_attention_interval:
                raise ValueError(
                    f"layers ({self.layers}) must be a multiple of full_attention_interval "
                    f"({self.full_attention_interval}) so the model ends with a full-attention layer"
                )
            if not 0 < self.linear_decay_min < self.linear_decay_max:
                raise ValueError("need 0 < linear_decay_min < linear_decay_max")
            if not 0 < self.moe_top_k <= self.moe_experts:
                raise ValueError("need 0 < moe_top_k <= moe_experts")
            if self.linear_value_heads % self.linear_key_heads:
                raise ValueError("linear_value_heads must be a multiple of linear_key_heads")

    def digest(self) -> str:
        blob = json.dumps({"v": GENERATOR_VERSION, **dataclasses.asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def layer_types(self) -> list[str]:
        if self.arch == "qwen3":
            return ["full_attention"] * self.layers
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.layers)
        ]


_PRESETS: dict[tuple[str, str], dict[str, int | float]] = {
    ("qwen3", "tiny"): {},
    ("qwen3-next", "tiny"): {},
    # Heavy: wider, GQA 8/2, so prefill of 3k tokens costs seconds on one CPU core while its KV is ~6 MiB.
    # (8 layers x 1024 wide took ~96 s for a 3k prefill here: too slow for tests and benches on this box.)
    ("qwen3", "heavy"): {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536},
    ("qwen3-next", "heavy"): {
        "layers": 4,
        "hidden": 512,
        "heads": 8,
        "kv_heads": 2,
        "intermediate": 1536,
        "linear_key_heads": 4,
        "linear_value_heads": 8,
    },
}


def preset_spec(arch: str, preset: str = "tiny", **overrides: int | float) -> TinySpec:
    """The spec of a named preset, with explicit shape overrides (``None`` values are ignored)."""
    if (arch, preset) not in _PRESETS:
        raise ValueError(f"unknown arch/preset {arch!r}/{preset!r}; archs {ARCHS}, presets {PRESETS}")
    values: dict[str, object] = {"arch": arch, "preset": preset, **_PRESETS[(arch, preset)]}
    known = {f.name for f in dataclasses.fields(TinySpec)}
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in known:
            raise ValueError(f"unknown spec field {key!r}")
        values[key] = value
    spec = TinySpec(**values)  # type: ignore[arg-type]
    spec.validate()
    return spec


# ---------------------------------------------------------------------------------------------------- tokenizer

_BASE_TEXT = """\
The cache holds keys and values for every token that came before. A block is valid only after exactly the same
preceding tokens, so the key of a block chains the key of the block before it. When a request arrives, the router
asks which replica already holds its prefix, whether a pool shard can supply it, or whether it is cheaper to
compute it again. Fetching wins when moving the bytes takes less time than recomputing them.
def prefill(tokens, cache):
    for i, block in enumerate(chunks(tokens, 128)):
        cache[key(i)] = attention(block)
    return cache
User: please summarise the following report in three sentences.
Assistant: The report describes a cluster of nodes, each with memory tiers, serving language models.
{"role": "system", "content": "You are a helpful assistant."}
0123456789 + - * / = < > ( ) [ ] { } ; : , . ! ? ' " _ # @ $ % & | ~ ^
"""

_SYLLABLES = (
    "ka ri to ne mu sa lo pe vi da gu chi ro ten mar sol qua zen bri fal dor kin lex mon nor pax ras sul tor "
    "vel wen yar zor an el in on un er ar or ir ur ast est ist ost ust ing ong ang ent ant ion tion sion"
).split()


def _corpus(seed: int) -> list[str]:
    """A built-in corpus: fixed English/code text plus seeded pseudo-words, enough for a few thousand merges."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    lines = [_BASE_TEXT] * 20
    for _ in range(4000):
        n = rng.randint(4, 16)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            sentence = sentence.capitalize() + "."
        if rng.random() < 0.1:
            sentence += f" {rng.randint(0, 99999)}"
        lines.append(sentence)
    return lines


def build_tokenizer(out_dir: Path, vocab: int, seed: int) -> int:
    """Train and save a byte-level BPE tokenizer with exactly ``vocab`` ids; returns the id of ``<|im_end|>``.

    Ids: the specials first, then the trained BPE, then ``MARKUP_TOKENS`` (added, not special), then
    ``<|reserved_i|>`` specials if the corpus ran out of merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    size = tok.get_vocab_size()
    if size < vocab:  # a small corpus ran out of merges: fill with reserved specials so every id decodes
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - size)])
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    fast.save_pretrained(str(out_dir))
    im_end = tok.token_to_id("<|im_end|>")
    if im_end is None:
        raise RuntimeError("tokenizer lost <|im_end|>")
    return im_end


# ---------------------------------------------------------------------------------------------------- model


def hf_config(spec: TinySpec, eos_id: int, pad_id: int):  # -> transformers.PretrainedConfig
    from transformers import Qwen3Config, Qwen3NextConfig

    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="bfloat16",
    )
    if spec.arch == "qwen3":
        return Qwen3Config(**common, layer_types=spec.layer_types(), use_sliding_window=False)
    return Qwen3NextConfig(
        **common,
        layer_types=spec.layer_types(),
        linear_num_key_heads=spec.linear_key_heads,
        linear_num_value_heads=spec.linear_value_heads,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_conv_kernel_dim=spec.conv_kernel,
        # vLLM's Qwen3Next needs at least one MoE layer: the last layer gets a small MoE, the others a dense MLP.
        num_experts=spec.moe_experts,
        num_experts_per_tok=spec.moe_top_k,
        moe_intermediate_size=max(spec.intermediate // 4, 1),
        shared_expert_intermediate_size=max(spec.intermediate // 4, 1),
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=list(range(spec.layers - 1)),
    )


def _write_weights(spec: TinySpec, out_dir: Path, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = hf_config(spec, eos_id, pad_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Re-draw every matrix from one seeded generator so the weights do not depend on module init order.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * spec.initializer_range)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # Qwen3 RMSNorm scales by w; Qwen3Next by (1 + w).
                param.fill_(spec.qk_norm_gain if spec.arch == "qwen3" else spec.qk_norm_gain - 1.0)
            elif name.endswith("A_log"):
                rates = torch.rand(param.shape, generator=gen) * (spec.linear_decay_max - spec.linear_decay_min)
                param.copy_((rates + spec.linear_decay_min).log())
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False).save_pretrained(str(out_dir))


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def make_tiny(spec: TinySpec, out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Build the model directory for ``spec`` at ``out_dir`` (skip if it already holds the same spec)."""
    spec.validate()
    out = Path(out_dir)
    marker = _read_marker(out)
    if marker is not None and marker.get("digest") == spec.digest() and not force:
        return out
    if out.exists() and any(out.iterdir()):
        if marker is None:
            raise FileExistsError(f"{out} exists and is not a kvstack tiny model directory; refusing to overwrite")
        if not force and marker.get("digest") != spec.digest():
            raise FileExistsError(
                f"{out} holds another tiny model (digest {marker.get('digest')}, want {spec.digest()}); "
                "pass force=True (--force) to rebuild it"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        eos_id = build_tokenizer(tmp, spec.vocab, spec.seed)
        from tokenizers import Tokenizer

        pad_id = Tokenizer.from_file(str(tmp / "tokenizer.json")).token_to_id("<|endoftext|>")
        _write_weights(spec, tmp, eos_id, pad_id)
        os.chmod(tmp, 0o755)
        for child in tmp.iterdir():
            os.chmod(child, 0o644)
        (tmp / MARKER_FILE).write_text(
            json.dumps({"digest": spec.digest(), "spec": dataclasses.asdict(spec)}, indent=2, sort_keys=True)
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_configured(arch: str, preset: str, out_dir: str | os.PathLike[str]) -> Path:
    """The tiny model a serve config names (``tiny_model.arch`` / ``.preset``) at its ``model_path``: built if absent,
    rebuilt if the directory holds another generated tiny model (older generator, other preset); any other non-empty
    directory is refused (``make_tiny``). Called by every launcher of a config (``kvstack serve``, the Ray Serve LLM
    anchor of ``bench.ray_serve_llm``)."""
    spec = preset_spec(arch, preset)
    marker = _read_marker(Path(out_dir))
    return make_tiny(spec, out_dir, force=marker is not None and marker.get("digest") != spec.digest())


def model_id(spec: TinySpec) -> str:
    """A stable model id for block-key namespaces: arch, preset and digest."""
    return f"tiny-{spec.arch}-{spec.preset}-{spec.digest()}"
