"""Checks of the Triton kernels against their PyTorch forms. Each takes the device to run on: "cuda" in the GPU
tests, "cpu" under Triton's interpreter (tests/kernels/test_triton_interpreter.py); some benchmarks reuse them."""
from __future__ import annotations

import torch


def check_tail_attention(device: str, dtype: torch.dtype, splits: int, rows_per_seq: int, tolerance: float,
                         heads: int = 32, kv_heads: int = 8, dim: int = 128) -> None:
    """The Triton decode kernel over draft-tree rows (the context through the page table, then a tail of
    scattered slots: none, one, many) against the PyTorch form of the same contract, computed in fp32 on the CPU.
    With rows_per_seq > 1, runs of rows share a sequence's context. On a GPU, or in Triton's interpreter."""
    from specserve.layers.attention import AttentionMetadata, attend_rows
    from specserve.kernels.triton.attention import paged_decode_attention

    torch.manual_seed(0)
    page, rows = 16, 6
    pool = torch.randn(2, 4096, kv_heads, dim, device=device, dtype=dtype)
    seqs = rows // rows_per_seq
    tables = torch.randint(0, 200, (seqs, 40), dtype=torch.int32, device=device).repeat_interleave(rows_per_seq, 0)
    lens = torch.tensor([1, 17, 300, 640, 64, 5], dtype=torch.int32, device=device)[:seqs]
    lens = lens.repeat_interleave(rows_per_seq)
    tails = torch.randint(3200, 4096, (rows, 6), device=device)
    tail_lens = torch.tensor([0, 1, 6, 3, 2, 6], dtype=torch.int32, device=device)
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    meta = AttentionMetadata(slot_mapping=tails[:, 0], block_tables=tables.cpu(), seq_lens=lens.cpu(), page_size=page,
                             tail_slots=tails.cpu(), tail_lens=tail_lens.cpu())
    reference = attend_rows(q.float().cpu(), pool.float().cpu(), meta, dim**-0.5)
    ours = paged_decode_attention(q, pool, tables, lens, dim**-0.5, page, splits, tails, tail_lens, rows_per_seq)
    torch.testing.assert_close(ours.float().cpu().view(rows, -1), reference, atol=tolerance, rtol=tolerance)


def check_closed_tail_attention(device: str, dtype: torch.dtype, splits: int, tolerance: float, heads: int = 32,
                                kv_heads: int = 8, dim: int = 128) -> None:
    """Verified trees (runs of rows sharing a context, each row's tail its ancestors' slots and its own) with
    the tails attended as one block per run (`closed_tails`), against the PyTorch form of the per-row contract in
    fp32 on the CPU. On a GPU, or in Triton's interpreter."""
    from specserve import envs
    from specserve.layers.attention import AttentionMetadata, attend_rows
    from specserve.kernels.triton.attention import paged_decode_attention

    torch.manual_seed(1)
    page, per_seq, depth = 16, 9, 4
    lens = torch.tensor([1, 300, 77], dtype=torch.int32)
    seqs = len(lens)
    tables = torch.randint(0, 200, (seqs, 40), dtype=torch.int32)
    tails, tail_lens = [], []
    for s in range(seqs):  # node 0 is the root (no tail); node i's parent comes before it, depth at most `depth`
        own = torch.randperm(800)[:per_seq] + 3200
        paths = [[]]
        for i in range(1, per_seq):
            parents = [p for p in range(i) if len(paths[p]) < depth]
            paths.append(paths[parents[torch.randint(len(parents), ()).item()]] + [own[i].item()])
        tails += [path + [own[-1].item()] * (depth - len(path)) for path in paths]  # padded with a run's own slot
        tail_lens += [len(path) for path in paths]
    tails, tail_lens = torch.tensor(tails), torch.tensor(tail_lens, dtype=torch.int32)
    rows = seqs * per_seq
    pool = torch.randn(2, 4096, kv_heads, dim, dtype=dtype)
    q = torch.randn(rows, heads, dim, dtype=dtype)
    row_tables, row_lens = tables.repeat_interleave(per_seq, 0), lens.repeat_interleave(per_seq)
    meta = AttentionMetadata(slot_mapping=tails[:, 0], block_tables=row_tables, seq_lens=row_lens, page_size=page,
                             tail_slots=tails, tail_lens=tail_lens)
    reference = attend_rows(q.float(), pool.float(), meta, dim**-0.5)
    on = [t.to(device) for t in (q, pool, row_tables, row_lens, tails, tail_lens)]
    with envs.override(closed_tails=True):  # whatever SPECSERVE_CLOSED_TAILS says
        ours = paged_decode_attention(*on[:4], dim**-0.5, page, splits, *on[4:], per_seq, closed_tails=True)
    torch.testing.assert_close(ours.float().cpu().view(rows, -1), reference, atol=tolerance, rtol=tolerance)


def tree_candidates(bs: int, k: int, depth: int, generator: torch.Generator):
    """A search's candidates as the tree program makes them ([bs, C]: target ids, parent candidate or -1,
    cumulative scores): each level's children hang off the k best of the level before, and scores step down
    by a few discrete amounts (zero included) so that ties are common."""
    steps = torch.tensor([0.0, -0.5, -0.5, -1.0, -2.0])
    tokens, parents, scores = [], [], []
    level_scores = steps[torch.randint(len(steps), (bs, k), generator=generator)].sort(dim=1, descending=True).values
    level_parents = torch.full((bs, k), -1)
    start = 0
    for level in range(depth):
        tokens.append(torch.randint(0, 1000, level_scores.shape, generator=generator))
        parents.append(level_parents)
        scores.append(level_scores)
        order = torch.sort(level_scores, dim=1, descending=True, stable=True).indices[:, :k]
        fed = torch.repeat_interleave(start + order, k, dim=1)
        value = steps[torch.randint(len(steps), (bs, k, k), generator=generator)].sort(dim=2, descending=True).values
        level_scores = (level_scores.gather(1, order)[..., None] + value).view(bs, k * k)
        level_parents = fed
        start += tokens[-1].shape[1]
    return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)


def fake_tree_program(bs: int, k: int, depth: int, n: int):
    """What TreeGraphs' PyTorch `_select`, `_leaf` and `_emit` read, for `bs` sequences of an n-node tree of top-k
    over `depth` levels: limits that keep all, some and one of the N best, roots, and scratch and real slots."""
    from types import SimpleNamespace

    from specserve.speculative.programs.tree import candidate_depths

    return SimpleNamespace(
        num_drafts=n, device=torch.device("cpu"), depth=depth, fused=False, pad_slot=9999,
        candidate_depth=candidate_depths(k, depth), limit=torch.tensor([n, n // 2, 1, n])[:bs],
        root_ids=7 + torch.arange(bs), root_slots=70 + 10 * torch.arange(bs), root_pos=300 + 7 * torch.arange(bs),
        target_scratch=1000 + torch.arange(bs * n).view(bs, n),
        real_slots=5000 + torch.arange(bs * depth).view(bs, depth))


def check_tree_select(device: str) -> None:
    """triton_tree.select_nodes against TreeGraphs._select's PyTorch form: every output equal (the verify's rows
    too: `_verify_rows`), with tied scores, and limits that keep all, some and one of the N best."""
    from specserve.kernels.triton import tree as triton_tree
    from specserve.speculative.programs.tree import TreeGraphs

    generator = torch.Generator().manual_seed(3)
    for k, depth, n in ((4, 5, 15), (2, 3, 5), (3, 4, 20), (4, 1, 3)):
        bs = 3
        tokens, parents, scores = tree_candidates(bs, k, depth, generator)
        program = fake_tree_program(bs, k, depth, n)
        expected = TreeGraphs._select(program, bs, tokens, parents, scores)
        on = {name: getattr(program, name).to(device)
              for name in ("candidate_depth", "limit", "root_ids", "root_slots", "target_scratch", "root_pos")}
        candidates = {"tokens": tokens.to(device), "parents": parents.to(device), "scores": scores.to(device)}
        ours = triton_tree.select_nodes(candidates, on["candidate_depth"], on["limit"], on["root_ids"],
                                        on["root_slots"], on["target_scratch"], depth, on["root_pos"])
        for name, value in expected.items():
            assert torch.equal(ours[name].cpu(), value), (k, depth, n, name)
        for name, value in TreeGraphs._verify_rows(program, bs, expected).items():
            got = ours["verify_rows"][name]
            assert got.dtype == value.dtype and torch.equal(got.cpu(), value), (k, depth, n, name)


def check_tree_accept(device: str) -> None:
    """triton_tree.accept_tree against TreeGraphs' PyTorch forms (`_leaf`, `_emit`, `pack_tokens`, and the slots
    `_move_accepted` moves): greedy, with a path matched to a random depth in each tree, and forced (simulated)."""
    from specserve.kernels.triton import tree as triton_tree
    from specserve.speculative.programs.base import pack_tokens
    from specserve.speculative.programs.tree import TreeGraphs

    generator = torch.Generator().manual_seed(5)
    for k, depth, n in ((4, 5, 15), (2, 3, 5), (3, 4, 20), (4, 1, 3)):
        bs = 4
        tokens, parents, scores = tree_candidates(bs, k, depth, generator)
        program = fake_tree_program(bs, k, depth, n)
        pad = program.pad_slot
        nodes = TreeGraphs._select(program, bs, tokens, parents, scores)
        best = torch.randint(0, 1000, (bs, n + 1), generator=generator)
        for b in range(bs):  # the target chooses the tokens on the way to a random node
            node = torch.randint(n + 1, (), generator=generator).item()
            while node:
                best[b, nodes["parent"][b, node]] = nodes["tokens"][b, node]
                node = nodes["parent"][b, node].item()
        for forced in (None, torch.tensor([0, 1, depth, depth + 3])):
            leaf = TreeGraphs._leaf(program, bs, nodes, best, forced)
            tokens_out, accepted, path = TreeGraphs._emit(program, nodes, leaf, best.gather(1, leaf[:, None])[:, 0])
            keep = torch.arange(depth)[None, :] < accepted[:, None]
            src = torch.where(keep, nodes["slots"].gather(1, path), pad)
            dst = torch.where(keep, program.real_slots, pad)
            roots = torch.tensor([3, 4, 5, 6])
            last_packed = torch.zeros(bs + 1, depth + 2, dtype=torch.long, device=device)
            last_root = torch.zeros(bs + 1, dtype=torch.long, device=device)
            ours = triton_tree.accept_tree({name: t.to(device) for name, t in nodes.items()}, best.to(device),
                                           None if forced is None else forced.to(device), program.real_slots.to(device),
                                           pad, roots.to(device), last_packed, last_root)
            expected = pack_tokens(tokens_out, accepted)
            assert torch.equal(ours[0].cpu(), expected), (k, depth, forced)
            assert torch.equal(ours[1].cpu(), src) and torch.equal(ours[2].cpu(), dst), (k, depth, forced)
            assert torch.equal(last_packed[:bs].cpu(), expected) and torch.equal(last_root[:bs].cpu(), roots)
            assert (accepted >= min(2, depth)).any() or forced is not None  # some tree accepted a long path


def check_tree_expand(device: str, dtype: torch.dtype) -> None:
    """triton_tree.expand_level against the PyTorch form of a search level (TreeGraphs._search): the children's
    candidates, and what is fed next (tokens, scores, candidate numbers, parents' states, paths), with ties."""
    from specserve.kernels.triton import tree as triton_tree

    generator = torch.Generator().manual_seed(4)
    steps = torch.tensor([0.0, -0.5, -0.5, -1.0, -2.0])
    for k, level, last, mapped in ((4, 1, False, True), (4, 3, False, True), (4, 4, True, True), (3, 2, False, False)):
        bs, hidden, vocab, column = 3, 2500, 500, 11
        values = steps[torch.randint(len(steps), (bs * k, k), generator=generator)].sort(1, descending=True).values
        indices = torch.randint(0, vocab, (bs * k, k), generator=generator)
        d2t = torch.randint(0, 5000, (vocab,), generator=generator) if mapped else torch.zeros(vocab, dtype=torch.long)
        fed_scores = steps[torch.randint(len(steps), (bs, k), generator=generator)]
        frontier = torch.randint(0, 50, (bs, k), generator=generator)
        states = torch.randn(bs * k, hidden, generator=generator).to(dtype)
        path = torch.randint(0, 9000, (bs * k, level), generator=generator)
        own = torch.randint(0, 9000, (bs, 2 * k), generator=generator)
        # The PyTorch form
        child_scores = (fed_scores[..., None] + values.view(bs, k, k)).view(bs, k * k)
        child_tokens = (indices + d2t[indices]).view(bs, k * k)
        order = torch.sort(child_scores, dim=-1, descending=True, stable=True).indices[:, :k]
        parent = order // k
        expected = {"tokens": child_tokens.gather(1, order), "scores": child_scores.gather(1, order),
                    "frontier": column + order,
                    "states": states.view(bs, k, -1).gather(1, parent[..., None].expand(-1, -1, hidden)).view(
                        bs * k, hidden),
                    "path": torch.cat([path.view(bs, k, level).gather(1, parent[..., None].expand(-1, -1, level)),
                                       own[:, :k, None]], dim=-1).view(bs * k, level + 1)}
        c = column + k * k + 3
        long = dict(dtype=torch.long, device=device)
        candidates = {"tokens": torch.full((bs, c), -5, **long), "parents": torch.full((bs, c), -5, **long),
                      "scores": torch.full((bs, c), 9.0, device=device)}
        out = {"tokens": torch.zeros(bs, k, **long), "scores": torch.zeros(bs, k, device=device),
               "frontier": torch.zeros(bs, k, **long),
               "states": torch.zeros(bs * k, hidden, dtype=dtype, device=device),
               "path": torch.zeros(bs * k, level + 1, **long)}
        on = [t.to(device) for t in (values, indices, d2t, fed_scores, frontier, states, path, own)]
        on[2] = on[2] if mapped else None  # a head with the target's vocabulary maps nothing
        triton_tree.expand_level(*on, candidates, column, level, last, out)
        span = slice(column, column + k * k)
        assert torch.equal(candidates["tokens"][:, span].cpu(), child_tokens)
        assert torch.equal(candidates["scores"][:, span].cpu(), child_scores)
        assert torch.equal(candidates["parents"][:, span].cpu(), frontier.repeat_interleave(k, dim=1))
        assert (candidates["tokens"][:, :column] == -5).all() and (candidates["tokens"][:, span.stop:] == -5).all()
        for name, value in expected.items():  # the last level feeds nothing
            assert (out[name] == 0).all() if last else torch.equal(out[name].cpu(), value), (k, level, name)


def check_tree_step_rows(device: str) -> None:
    """triton_tree.step_rows against TreeGraphs._step_rows (the PyTorch form of `_metas`): every row input equal,
    with page tables of a stride wider than their pages and page counts that do not fill the kernel's blocks."""
    from types import SimpleNamespace

    from specserve.kernels.triton import tree as triton_tree
    from specserve.speculative.programs.tree import TreeGraphs

    generator = torch.Generator().manual_seed(6)
    for k, depth, num_drafts, pages in ((4, 5, 16, 70), (3, 1, 3, 5), (2, 3, 6, 129)):
        bs, width = 3, depth + 1
        wide = torch.randint(0, 1000, (bs, pages + 5), generator=generator, dtype=torch.int32)
        table = wide[:, :pages]
        program = SimpleNamespace(
            topk=k, depth=depth, num_drafts=num_drafts, width=width, tables={64: table},
            root_pos=torch.randint(0, 5000, (bs,), generator=generator),
            catch_pos=torch.randint(0, 5000, (bs, width), generator=generator),
            level_lens=torch.arange(depth, dtype=torch.int32)[:, None].repeat(1, bs * k))
        expected = TreeGraphs._step_rows(program, bs, 64)
        out = {name: torch.full_like(value, -3).to(device) for name, value in expected.items()}
        triton_tree.step_rows(program.catch_pos.to(device), program.root_pos.to(device), wide.to(device)[:, :pages],
                              out)
        for name, value in expected.items():
            assert out[name].dtype == value.dtype and torch.equal(out[name].cpu(), value), (k, depth, name)


def check_tree_root_children(device: str, dtype: torch.dtype) -> None:
    """triton_tree.root_children against the PyTorch form of the search's first level (TreeGraphs._search): the
    root's children as the first candidates (and nothing past them), and fed next with the root's state."""
    from specserve.kernels.triton import tree as triton_tree

    generator = torch.Generator().manual_seed(7)
    for k, hidden, mapped in ((4, 2500, True), (3, 64, False), (1, 5, True)):
        bs, c, vocab = 3, 30, 500
        values = torch.randn(bs, k, generator=generator).sort(dim=1, descending=True).values
        indices = torch.randint(0, vocab, (bs, k), generator=generator)
        d2t = torch.randint(0, 5000, (vocab,), generator=generator)
        state = torch.randn(bs, hidden + 3, generator=generator).to(dtype)[:, :hidden]  # rows wider than the state
        tokens = indices + d2t[indices] if mapped else indices
        long = dict(dtype=torch.long, device=device)
        candidates = {"tokens": torch.full((bs, c), -5, **long), "scores": torch.full((bs, c), 9.0, device=device)}
        fed = {"tokens": torch.zeros(bs, k, **long), "scores": torch.zeros(bs, k, device=device),
               "states": torch.zeros(bs * k, hidden, dtype=dtype, device=device)}
        triton_tree.root_children(values.to(device), indices.to(device), d2t.to(device) if mapped else None,
                                  state.to(device), candidates, fed)
        assert torch.equal(candidates["tokens"][:, :k].cpu(), tokens) and (candidates["tokens"][:, k:] == -5).all()
        assert torch.equal(candidates["scores"][:, :k].cpu(), values) and (candidates["scores"][:, k:] == 9.0).all()
        assert torch.equal(fed["tokens"].cpu(), tokens) and torch.equal(fed["scores"].cpu(), values)
        assert torch.equal(fed["states"].cpu(), state.repeat_interleave(k, dim=0)), (k, hidden)


def check_tree_move(device: str, dtype: torch.dtype) -> None:
    """triton_tree.move_slots against TreeGraphs._move_slots (the KV of every layer and the head's taps, moved
    from the accepted nodes' scratch slots to their positions' slots), with pairs of padding slots among them."""
    from types import SimpleNamespace

    from specserve.kernels.triton import tree as triton_tree
    from specserve.speculative.programs.tree import TreeGraphs
    from specserve.speculative.drafters.eagle3 import Eagle3Drafter

    generator = torch.Generator().manual_seed(8)
    for layers, kv_heads, dim, hidden in ((3, 2, 8, 48), (2, 8, 128, 4096)):
        slots, pad = 40, 39
        kv = torch.randn(layers, 2, slots, kv_heads, dim, generator=generator).to(dtype)
        taps = torch.randn(slots, hidden, generator=generator).to(dtype)
        src, dst = torch.tensor([10, 11, pad, 12, pad]), torch.tensor([30, 31, pad, 5, pad])
        expected = SimpleNamespace(kv_cache=kv.clone(), drafter=SimpleNamespace(taps=taps.clone()))
        expected.drafter.move_slots = lambda s, d: Eagle3Drafter.move_slots(expected.drafter, s, d)
        TreeGraphs._move_slots(expected, src, dst)
        kv_on, taps_on = kv.to(device, copy=True), taps.to(device, copy=True)
        triton_tree.move_slots(kv_on, taps_on, src.to(device), dst.to(device), pad)
        assert torch.equal(kv_on.cpu(), expected.kv_cache) and torch.equal(taps_on.cpu(), expected.drafter.taps)
        assert not torch.equal(kv_on.cpu(), kv)  # something moved


def check_argmax(device: str, dtype: torch.dtype) -> None:
    """The argmax kernels (kernels/triton/argmax.py) against torch.argmax: vocabularies of one block, of many and
    not a multiple of the block, a row stride wider than the row, ties at the top across blocks, a NaN, a row of
    -inf, and leading dimensions [batch, rows]; and each pick mapped through offsets (a draft vocabulary's ids to
    the target's). On a GPU, or in Triton's interpreter."""
    from specserve.kernels.triton.argmax import argmax

    torch.manual_seed(0)
    for rows, vocab in ((1, 128256), (4, 32000), (17, 2048), (3, 70), (2, 5000)):
        logits = (torch.randn(rows, vocab + 3, device=device) * 4).to(dtype)[:, :vocab]
        logits[0, [vocab - 1, vocab // 2, 5 % vocab]] = logits[0].max() + 1  # a three-way tie: the lowest wins
        if rows > 2:
            logits[1, [vocab // 3, vocab - 2]] = float("nan")  # a NaN beats every number: the first one
            logits[1, vocab // 4] = float("inf")
            logits[2] = float("-inf")  # all equal: the first entry
        expected = logits.float().cpu().argmax(dim=-1)
        assert torch.equal(argmax(logits).cpu(), expected), (rows, vocab)
        assert torch.equal(argmax(logits.view(1, rows, vocab)).cpu(), expected.view(1, rows)), (rows, vocab)
        offsets = torch.randint(0, 100_000, (vocab,), device=device)
        assert torch.equal(argmax(logits, offsets).cpu(), expected + offsets.cpu()[expected]), (rows, vocab)
        into = torch.full((rows, 3), -1, device=device)  # a column of a buffer, as a chain's drafts are written
        assert argmax(logits, offsets, out=into[:, 1]).data_ptr() == into[:, 1].data_ptr()
        assert torch.equal(into[:, 1].cpu(), expected + offsets.cpu()[expected]) and (into[:, ::2] == -1).all()


def check_rms_norm_pair(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """The two-norm kernel (kernels/triton/pointwise.rms_norm_pair) against the eager norms and concatenation: rows
    of a width that is not a power of two, b a strided view, leading dimensions. On a GPU, or in Triton's
    interpreter."""
    from specserve.kernels import pointwise
    from specserve.kernels.triton import pointwise as triton_pointwise

    torch.manual_seed(0)
    a = torch.randn(2, 3, 96, device=device).to(dtype) * 4
    b = torch.randn(2, 3, 200, device=device).to(dtype)[..., 7:103]  # rows 200 apart
    weight_a, weight_b = (torch.rand(96, device=device).to(dtype) + 0.5 for _ in range(2))
    got = triton_pointwise.rms_norm_pair(a, weight_a, b, weight_b, 1e-5)
    expected = pointwise.eager_rms_norm_pair(a.cpu(), weight_a.cpu(), b.cpu(), weight_b.cpu(), 1e-5)
    assert got.shape == (2, 3, 192)
    torch.testing.assert_close(got.cpu(), expected, atol=tolerance, rtol=tolerance)
    # a as a table whose rows are looked up (the head's token embedding): ids repeated, and read with a stride.
    table = torch.randn(50, 96, device=device).to(dtype) * 4
    ids = torch.tensor([[7, 9, 0, 9, 49], [7, 9, 3, 9, 12]], device=device)[:, ::2]
    got = triton_pointwise.rms_norm_pair(table, weight_a, b, weight_b, 1e-5, ids)
    expected = pointwise.eager_rms_norm_pair(table.cpu(), weight_a.cpu(), b.cpu(), weight_b.cpu(), 1e-5,
                                                 ids.cpu())
    assert torch.equal(expected[..., :96], pointwise.eager_rms_norm(table.cpu()[ids.cpu()], weight_a.cpu(), 1e-5))
    torch.testing.assert_close(got.cpu(), expected, atol=tolerance, rtol=tolerance)
    got = triton_pointwise.rms_norm_pair(table, weight_a, b[0], weight_b, 1e-5, ids[0])  # one strided row of ids
    torch.testing.assert_close(got.cpu(), expected[0], atol=tolerance, rtol=tolerance)


def check_accept_and_pack(device: str) -> None:
    """The chain's acceptance kernel (kernels/triton/accept.py) against accept_chain and pack_tokens: every prefix of
    matches (none, some, all), a mismatch after a match, limits below and above the matches, forced counts (also
    above the limit); a root read with a stride, as the program passes it; the copies a following step reads.
    On a GPU, or in Triton's interpreter."""
    from specserve.speculative.accept import accept_chain
    from specserve.speculative.programs.base import pack_tokens
    from specserve.kernels.triton.accept import accept_and_pack

    torch.manual_seed(0)
    for k in (1, 3, 5):
        rows = 64
        best = torch.randint(0, 4, (rows, k + 1), device=device)
        drafts = torch.where(torch.rand(rows, k, device=device) < 0.7, best[:, :k], torch.randint(0, 4, (rows, k),
                                                                                                device=device))
        limit = torch.randint(0, k + 1, (rows,), device=device)
        roots = torch.randint(0, 10_000, (rows, k + 1), device=device)[:, 0]  # stride k + 1, like verify_pos[:, 0]
        for forced in (None, torch.randint(0, k + 2, (rows,), device=device)):
            last_packed = torch.full((rows + 3, k + 2), -1, dtype=torch.long, device=device)
            last_root = torch.full((rows + 3,), -1, dtype=torch.long, device=device)
            got = accept_and_pack(drafts, best, forced, limit, roots, last_packed, last_root)
            expected = pack_tokens(*accept_chain(drafts.cpu(), best.cpu(), None if forced is None else forced.cpu(),
                                             limit.cpu()))
            assert torch.equal(got.cpu(), expected), (k, forced)
            assert torch.equal(last_packed[:rows].cpu(), expected) and (last_packed[rows:] == -1).all()
            assert torch.equal(last_root[:rows].cpu(), roots.cpu()) and (last_root[rows:] == -1).all()


def check_chain_rows(device: str) -> None:
    """The chain program's per-row attention inputs from one kernel (kernels/triton/follow.chain_rows) against their
    PyTorch form: context lengths (to and including each row, or before a shared context's first row), tails,
    draft levels' lengths, the page table repeated per row, and each root as the verify's first id; rows past the
    batch left alone. A shared context's lengths and tails also against ChainGraphs' PyTorch form of them. On a
    GPU, or in Triton's interpreter."""
    from types import SimpleNamespace

    from specserve.speculative.programs.chain import ChainGraphs
    from specserve.kernels.triton.follow import chain_rows

    torch.manual_seed(0)
    for k, bs, max_bs, pages in ((3, 3, 4, 70), (1, 2, 2, 5), (5, 1, 8, 129)):
        w, n = k + 1, 16 * pages
        rand = lambda *shape: torch.randint(0, 10_000, shape, device=device)  # noqa: E731
        i32 = dict(dtype=torch.int32, device=device)
        program = SimpleNamespace(
            width=w, k=k, tables={n: torch.randint(0, 500, (max_bs, pages), **i32)}, root_ids=rand(max_bs),
            verify_ids=torch.full((max_bs, w), -1, dtype=torch.long, device=device),
            row_tables={n: torch.full((max_bs * w, pages), -1, **i32)},
            catch_pos=rand(max_bs, w), catch_slots=rand(max_bs, w), verify_pos=rand(max_bs, w),
            verify_slots=rand(max_bs, w), extend_pos=rand(max(k - 1, 1), max_bs),
            extend_lens=torch.full((max(k - 1, 1), max_bs), -1, **i32),
            row_lens={name: torch.full((max_bs * w,), -1, **i32) for name in ("catch", "verify")},
            row_tails={name: torch.full((max_bs * w, w), -1, dtype=torch.long, device=device)
                       for name in ("catch", "verify")})
        for shared in (False, True):
            chain_rows(program, bs, n, shared)
            rows = bs * w
            for name in ("catch", "verify"):
                pos, slots = getattr(program, f"{name}_pos")[:bs], getattr(program, f"{name}_slots")[:bs]
                lens = pos[:, :1].expand(bs, w) if shared else pos + 1
                assert torch.equal(program.row_lens[name][:rows].cpu(), lens.reshape(-1).int().cpu()), (k, name)
                assert (program.row_lens[name][rows:] == -1).all()
                if shared:
                    tails = slots.repeat_interleave(w, 0)
                    assert torch.equal(program.row_tails[name][:rows].cpu(), tails.cpu()), (k, name)
                    assert (program.row_tails[name][rows:] == -1).all()
                    # What the program's PyTorch form (its A/B switch) gives for the same rows.
                    meta = ChainGraphs._shared_context_meta(SimpleNamespace(page_size=16), slots, pos,
                                                            program.row_tables[n][:rows], 1, n)
                    assert torch.equal(meta.seq_lens.cpu(), program.row_lens[name][:rows].cpu()), (k, name)
                    assert torch.equal(meta.tail_slots.cpu(), tails.cpu()) and meta.rows_per_seq == w
                    assert torch.equal(meta.tail_lens.cpu(), torch.arange(1, w + 1, dtype=torch.int32).repeat(bs))
            if k > 1:
                assert torch.equal(program.extend_lens[:, :bs].cpu(), (program.extend_pos[:, :bs] + 1).int().cpu())
            else:  # no draft levels: the one placeholder level stays unwritten
                assert (program.extend_lens == -1).all()
            assert (program.extend_lens[:, bs:] == -1).all()
            assert torch.equal(program.verify_ids[:bs, 0].cpu(), program.root_ids[:bs].cpu())
            assert (program.verify_ids[:, 1:] == -1).all() and (program.verify_ids[bs:] == -1).all()
            expected = program.tables[n][:bs].repeat_interleave(w, 0)
            assert torch.equal(program.row_tables[n][:rows].cpu(), expected.cpu()), k
            assert (program.row_tables[n][rows:] == -1).all()
