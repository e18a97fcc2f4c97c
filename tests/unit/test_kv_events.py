"""KeyTranslator: vLLM KV events re-keyed into kvstack's chained keys (exactly the ingress's keys)."""

from __future__ import annotations

from kvpool.keys import chain_keys
from deployments.kv_events import KeyTranslator
from router.wire import routing_root

ROOT = routing_root("tiny-qwen3")


def root_of(salt: str):
    return routing_root("tiny-qwen3", salt)
BS = 4


def _translator():
    log: dict[str, list] = {"stored": [], "removed": [], "cleared": 0}
    t = KeyTranslator(
        root_of,
        on_stored=lambda keys: log["stored"].extend(keys),
        on_removed=lambda keys: log["removed"].extend(keys),
        on_cleared=lambda: log.__setitem__("cleared", log["cleared"] + 1),
    )
    return t, log


def test_chained_events_give_the_ingress_keys() -> None:
    tokens = list(range(100, 112))  # 3 blocks of 4
    expected = [bytes(k) for k in chain_keys(ROOT, tokens, BS)]
    t, log = _translator()
    t.stored([11, 12], None, tokens[:8], BS)  # first two blocks in one event
    t.stored([13], 12, tokens[8:12], BS)  # third block, parent = vLLM hash 12
    assert log["stored"] == expected


def test_removed_and_cleared() -> None:
    tokens = list(range(8))
    t, log = _translator()
    t.stored([1, 2], None, tokens, BS)
    t.removed([2, 99])  # 99 was never stored: ignored
    assert log["removed"] == [bytes(chain_keys(ROOT, tokens, BS)[1])]
    t.cleared()
    assert log["cleared"] == 1
    t.removed([1])  # forgotten by the clear
    assert len(log["removed"]) == 1


def test_unknown_parent_is_skipped_not_guessed() -> None:
    t, log = _translator()
    t.stored([5], 4242, list(range(4)), BS)
    assert log["stored"] == [] and t.skipped == 1


def test_partial_token_list_keys_only_full_blocks() -> None:
    t, log = _translator()
    t.stored([1, 2], None, list(range(6)), BS)  # 1.5 blocks of tokens for 2 hashes: only the full one is keyed
    assert len(log["stored"]) == 1


def _stored_event(hashes, parent, tokens, extra_keys=None, lora_name=None):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium="GPU", lora_name=lora_name, extra_keys=extra_keys)


def test_a_salted_first_block_is_keyed_under_its_salts_root() -> None:
    """vLLM hashes a request's cache_salt into its first block and says so in the event's extra keys: the keys are
    the ingress's keys under that salt, and the same tokens unsalted (another tenant) get other keys."""
    tokens = list(range(100, 112))
    t, log = _translator()
    t.apply(_stored_event([1, 2], None, tokens[:8], extra_keys=[("kvs1-tenant-a",), None]))
    t.apply(_stored_event([3], 2, tokens[8:12]))
    t.apply(_stored_event([7], None, tokens[:4]))  # the same first block, no salt
    salted = [bytes(k) for k in chain_keys(root_of("kvs1-tenant-a"), tokens, BS)]
    assert log["stored"] == salted + [bytes(chain_keys(ROOT, tokens, BS)[0])]
    assert salted[0] != bytes(chain_keys(ROOT, tokens, BS)[0])


def test_first_blocks_with_more_than_a_salt_are_skipped() -> None:
    """A LoRA adapter's blocks, or a multimodal item's, are not the base model's prefix: never reported (nor their
    children)."""
    t, log = _translator()
    t.apply(_stored_event([1], None, list(range(4)), lora_name="adapter"))
    t.apply(_stored_event([2], None, list(range(4)), extra_keys=[(("img", 0), "salt")]))
    t.apply(_stored_event([3], 1, list(range(4, 8))))
    assert log["stored"] == [] and t.skipped == 3
