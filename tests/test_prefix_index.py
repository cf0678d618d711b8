"""The torch-free index of shared prompt heads."""
from appliance.engine.llm.prefix_index import MIN_SHARED_TOKENS, PrefixIndex

HEAD = list(range(100, 100 + MIN_SHARED_TOKENS + 4))


def test_lookup_hits_only_stored_heads_and_counts():
    index = PrefixIndex(2)
    tokens = HEAD + [1, 2, 3]
    assert index.lookup(tokens, len(HEAD)) is None
    key = index.wanted(tokens, len(HEAD))
    assert key == tuple(HEAD)
    index.add(key)
    assert index.wanted(tokens, len(HEAD)) is None  # already stored
    assert index.lookup(HEAD + [9], len(HEAD)) == key and index.hits == 1
    assert index.lookup(tokens, MIN_SHARED_TOKENS - 1) is None  # too short to be worth a copy


def test_least_recently_used_heads_are_evicted_and_reported_once():
    index = PrefixIndex(2)
    keys = [tuple(HEAD + [i]) for i in range(3)]
    index.add(keys[0])
    index.add(keys[1])
    index.lookup(list(keys[0]) + [7], len(keys[0]))  # keys[0] used again: keys[1] is now the oldest
    index.add(keys[2])
    assert index.take_evicted() == [keys[1]] and index.take_evicted() == []
    index.clear()
    assert len(index) == 0 and sorted(index.take_evicted()) == sorted([keys[0], keys[2]])


def test_zero_capacity_shares_nothing():
    index = PrefixIndex(0)
    assert index.wanted(HEAD + [1], len(HEAD)) is None and index.lookup(HEAD + [1], len(HEAD)) is None
