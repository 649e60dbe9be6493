"""Sizes in human units; chunk packing (first-use order, decay ranges, tied chunk); Belady's OPT."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, ModelInfo, lm_cross_entropy
from stratum.model.gpt import build_gpt
from stratum.offload.belady import NextUse, Traffic, simulate_step
from stratum.offload.chunks import outliers, pack
from stratum.units import fmt_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize("text,n", [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 G", 1_500_000_000),
                                    ("100", 100), ("4kb", 4000), ("3KiB", 3072), (".5MB", 500_000)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "two GB", "2XB", "-1GB", "1e9", "GB"])
def test_parse_bytes_refuses_with_one_line(bad):
    with pytest.raises(StratumError, match="offload.x = .* is not a size") as e:
        parse_bytes(bad, "offload.x")
    assert "\n" not in str(e.value)


def test_budgets():
    assert parse_budget("", "k") is None and parse_budget("auto", "k") is None
    with pytest.raises(StratumError, match="positive"):
        parse_budget("0", "offload.device_budget")
    assert fmt_bytes(3 * 2**30) == "3.00 GiB" and fmt_bytes(None) == "unlimited"


def test_pack_first_use_order_decay_first_and_tied_private_chunk():
    seq = build_gpt("tiny", vocab_size=256, seed=0, device="meta")
    biggest = max(p.numel() for n, p in seq.named_parameters() if n != seq.tied[0].owner)
    lay = pack(seq, biggest * 2)
    tied = lay.chunks[0]
    assert tied.tied and [e.name for e in tied.entries] == [seq.tied[0].owner]
    assert 0 in lay.block_chunks[0] and 0 in lay.block_chunks[-1]  # embedding and head share it
    order = [e.name for c in lay.chunks[1:] for e in c.entries]
    names = [n for n, _ in seq.named_parameters() if n != seq.tied[0].owner]
    assert sorted(order) == sorted(names)
    for c in lay.chunks:
        assert c.used <= c.capacity
        decay = [e for e in c.entries if e.offset < c.n_decay]
        assert all(e.param.ndim >= 2 for e in decay) and all(e.param.ndim < 2 for e in c.entries[len(decay):])
    # first-use order: the chunks a block uses never go back to an earlier chunk than a previous block's first
    firsts = [min(c for c in cs if c != 0) for cs in lay.block_chunks if [c for c in cs if c != 0]]
    assert firsts == sorted(firsts)
    assert lay.ready_block[0] == 0


def test_outliers_are_pinned_only_where_chunks_are_smaller_than_them():
    """A pipeline rank's first block (GPT's embedding, its tie to the head elsewhere) and a model with an untied
    embedding and head: the one or two parameters more than twice any other stream where a chunk holds them and
    are pinned in a chunk of their own where the chunks are smaller; nothing else is an outlier."""
    whole = build_gpt("tiny", vocab_size=4096, seed=0, device="meta")
    first = whole.part([0])
    emb = "blocks.0." + whole.tied[0].owner.split(".", 2)[2]
    n_emb = dict(first.named_parameters())[emb].numel()
    assert first.tied == [] and outliers(first) == {emb: n_emb}
    assert not any(c.pinned for c in pack(first, n_emb).chunks)
    small = pack(first, n_emb // 4)
    assert small.chunks[0].pinned and not small.chunks[0].tied
    assert [e.name for e in small.chunks[0].entries] == [emb]
    assert [e.name for c in small.chunks[1:] for e in c.entries] == [n for n in dict(first.named_parameters())
                                                                      if n != emb]
    assert outliers(whole) == {}  # the tied embedding aside, no parameter is twice another
    info = ModelInfo(name="untied")
    untied = BlockSeq([nn.Embedding(1000, 16), nn.Linear(16, 16), nn.Linear(16, 1000)], lm_cross_entropy, info)
    assert outliers(untied) == {"blocks.0.weight": 16000, "blocks.2.weight": 16000}
    lay = pack(untied, 1000)
    assert lay.chunks[0].pinned and [e.name for e in lay.chunks[0].entries] == ["blocks.0.weight", "blocks.2.weight"]
    assert lay.ready_block[0] == 0 and lay.max_chunks_per_block() == 1
    three = BlockSeq([nn.Embedding(1000, 16), nn.Linear(16, 1000), nn.Linear(1000, 16)], lm_cross_entropy, info)
    assert outliers(three) == {}
    uneven = BlockSeq([nn.Embedding(1000, 16), nn.Linear(16, 16), nn.Linear(16, 100)], lm_cross_entropy, info)
    assert outliers(uneven) == {"blocks.0.weight": 16000, "blocks.2.weight": 1600}  # a head 6× the rest too


def test_chunk_smaller_than_a_parameter_is_refused():
    seq = build_gpt("tiny", vocab_size=256, seed=0, device="meta")
    with pytest.raises(StratumError, match="smaller than the largest parameter"):
        pack(seq, 100)


def _brute_force_min_fetches(seq, slots):
    """Fewest fetches of one pass over ``seq`` from a cold cache, by exhaustive choice of victims."""
    best = [10**9]

    def go(t, resident, fetched):
        if fetched >= best[0]:
            return
        if t == len(seq):
            best[0] = fetched
            return
        need = set(seq[t])
        missing = [c for c in seq[t] if c not in resident]
        if not missing:
            return go(t + 1, resident, fetched)
        c = missing[0]
        if len(resident) < slots:
            return go(t, resident | {c}, fetched + 1)
        for v in resident - need:
            go(t, (resident - {v}) | {c}, fetched + 1)
    go(0, frozenset(), 0)
    return best[0]


def test_belady_is_optimal_on_small_sequences():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        seq = [(int(x),) for x in torch.randint(0, 5, (10,), generator=g)]
        for slots in (1, 2, 3):
            assert simulate_step(seq, slots, steps=1).fetches == _brute_force_min_fetches(seq, slots)


def test_gradients_round_trip_between_micro_batches_as_simulated():
    """Three one-chunk blocks, two micro-batches, one slot. Steady-state step, access by access:
    F0 hit; F1 fetch; F2 fetch; B2 hit, gradient starts in the slot; B1 fetch, evicts 2 with its gradient (write);
    B0 fetch, evicts 1 (write) | F0 hit; F1 fetch, evicts 0 (write, by a forward); F2 fetch, evicts 1 (its
    gradient is home: nothing to write); B2 hit, its gradient comes back (read), complete; B1 fetch + read,
    complete; B0 fetch + read, complete."""
    seq = [(0,), (1,), (2,), (2,), (1,), (0,)] * 2
    wants = [False, False, False, True, True, True] * 2
    consumed = {2: 9, 1: 10, 0: 11}
    assert simulate_step(seq, 1, wants=wants, consumed=consumed) == Traffic(fetches=8, grad_reads=3, grad_writes=3,
                                                                            grad_writes_fwd=1)
    # updated at home, every chunk starts the step cold (F0 misses too); without gradients in slots: no round trips
    assert simulate_step(seq, 1, wants=wants, consumed=consumed, stale=frozenset({0, 1, 2})).fetches == 9
    assert simulate_step(seq, 1) == Traffic(fetches=8)
    # three slots hold everything: no fetch, no gradient leaves its slot
    assert simulate_step(seq, 3, wants=wants, consumed=consumed) == Traffic(fetches=0)


def test_next_use_wraps_to_the_next_step():
    nu = NextUse([(0,), (1,), (2,), (1,)])
    assert nu.after(1, 1) == 3 and nu.after(0, 0) == 4 and nu.after(2, 3) == 6 and nu.after(7, 0) == float("inf")


def test_full_disk_is_a_clear_error_and_files_are_removed(tmp_path, monkeypatch):
    """ENOSPC while writing a chunk file is a one-line StratumError, not a corrupt run; close() removes the files."""
    import errno

    from stratum.offload.tiers import ALIGN, DiskStore, Tier

    store = DiskStore(tmp_path, Tier("disk", None))
    store.create("ok", torch.ones(8))
    assert torch.equal(store.read("ok", torch.empty(8)), torch.ones(8))
    import os

    real = os.pwritev

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(StratumError, match="is full; free space"):
        store.create("big", torch.ones(8))
    with pytest.raises(StratumError, match="is full"):
        store.write_range("ok", 0, torch.zeros(2))
    monkeypatch.setattr(os, "pwritev", real)
    assert torch.equal(store.read("ok", torch.empty(8)), torch.ones(8))  # the failed writes corrupted nothing
    assert store.file_bytes() == store.tier.used == 2 * ALIGN and not list(tmp_path.iterdir())  # nameless files
    store.close()
    assert store.tier.used == 0 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("direct", [True, False])
def test_disk_ranges_aligned_and_not_round_trip(tmp_path, direct):
    """Aligned buffers move directly; any other range goes through a bounce buffer and keeps its neighbours."""
    from stratum.offload.tiers import ALIGN, DiskStore, Tier, aligned_empty, direct_io_works

    store = DiskStore(tmp_path, Tier("disk", None))
    store.direct = direct and direct_io_works(tmp_path)
    n = 3 * ALIGN // 4
    src = aligned_empty(n)
    src.copy_(torch.arange(n, dtype=torch.float32))
    store.create("a", src)
    assert store.file_bytes() == 3 * ALIGN
    got = store.read("a", aligned_empty(n))
    assert torch.equal(got, src) and store.bounce_bytes == 0  # the hot path never bounces
    store.write_range("a", 5, torch.full((7,), -1.0))  # unaligned offset and length
    want = src.clone()
    want[5:12] = -1.0
    assert torch.equal(store.read("a", torch.empty(n)), want)
    assert torch.equal(store.read_range("a", 1020, torch.empty(10)), want[1020:1030])  # across a block edge
    assert store.bounce_bytes > 0 if store.direct else store.bounce_bytes == 0
    with pytest.raises(StratumError, match="truncated"):
        store.read_range("a", n - 2, torch.empty(4))
    store.close()


def test_long_lived_cpu_buffers_are_page_aligned_mappings():
    """Slots, staging and ring buffers are their own mappings: page-aligned for direct I/O (whatever glibc's
    heap does), any size, empty included; the allocator policy calls are safe to repeat."""
    from stratum.offload.host_alloc import PAGE, page_aligned_empty, release_free_heap, tune_allocator
    from stratum.offload.tiers import aligned_empty
    tune_allocator()
    for n in (1, 4095, 4096, 3 * PAGE + 5):
        t = page_aligned_empty(n)
        assert t.numel() == n and t.dtype == torch.uint8 and t.data_ptr() % PAGE == 0
        t.fill_(7)
        assert int(t.sum()) == 7 * n
    assert page_aligned_empty(0).numel() == 0
    f = aligned_empty(1000)
    assert f.dtype == torch.float32 and f.numel() == 1000 and f.data_ptr() % PAGE == 0
    release_free_heap()


def _mapped(ptr: int) -> bool:
    """Whether ``ptr`` lies in one of this process's mappings (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_pinned_buffers_are_registered_at_their_own_size_and_unregistered_before_unmapped(monkeypatch):
    """A GPU's host-tier buffers are page-locked at their page-rounded size (torch's pinned allocator would lock
    the next power of two: 2x for a chunk just over one) and unregistered when the last view of them dies, while
    the pages are still mapped; they are unmapped after. CUDA's calls are faked: this machine may have no GPU."""
    from stratum.offload import host_alloc
    from stratum.offload.tiers import aligned_empty
    calls = []
    monkeypatch.setattr(host_alloc, "cuda_host_register", lambda ptr, n: calls.append(("register", ptr, n)))
    monkeypatch.setattr(host_alloc, "cuda_host_unregister",
                        lambda ptr: calls.append(("unregister", ptr, _mapped(ptr))))
    n = (1 << 20) + 1  # elements of fp32: 4 MiB + 4 bytes, one page over a power of two
    t = aligned_empty(n, torch.float32, pin=True)
    assert t.numel() == n and t.dtype == torch.float32 and t.data_ptr() % host_alloc.PAGE == 0
    ptr = t.data_ptr()
    assert calls == [("register", ptr, (4 << 20) + host_alloc.PAGE)]
    t.fill_(3.0)
    view = t[10:20]
    del t
    gc.collect()
    assert len(calls) == 1 and float(view.sum()) == 30.0  # a view keeps the buffer pinned
    del view
    gc.collect()
    assert calls[1] == ("unregister", ptr, True) and not _mapped(ptr)
    assert host_alloc.pinned_empty(0).numel() == 0 and len(calls) == 2


def test_pinning_that_fails_names_the_budget_to_lower(monkeypatch):
    """cudaHostRegister's error (a host tier larger than the memory the system lets be locked) is one line."""
    from stratum.offload import host_alloc

    class FakeCudart:
        def cudaHostRegister(self, ptr, n, flags):
            return 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(host_alloc.torch.cuda, "cudart", lambda: FakeCudart())
    with pytest.raises(StratumError, match="could not page-lock 8,192 bytes .*cudaError 2.*offload.host_budget"):
        host_alloc.pinned_empty(8192)


def test_heap_trim_spends_at_most_its_share_of_the_time(monkeypatch):
    """The step-end heap trim runs on the first call, then only while its own seconds stay within its share of
    the seconds between calls (a fake clock: each trim costs 1, each step 10; share 0.05 → every other step)."""
    from stratum.offload import host_alloc
    clock = [0.0]
    calls = []

    def trim():
        calls.append(clock[0])
        clock[0] += 1.0
    monkeypatch.setattr(host_alloc, "release_free_heap", trim)
    monkeypatch.setattr(host_alloc.time, "perf_counter", lambda: clock[0])
    t = host_alloc.HeapTrim(share=0.05)
    for _ in range(8):
        t.step_end()
        clock[0] += 10.0
    assert calls == [0.0, 21.0, 42.0, 63.0] and t.spent == 4.0
    assert t.spent <= t.share * t.elapsed + 1.0  # one call over at most (the one that found it under)
