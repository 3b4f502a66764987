"""How a draw is shared among generator workers (grpolab/rollout/remote/parts.py): the parts cover every row once, in
order, as evenly as they go, and merging the workers' answers gives the batch one draw of all rows would give."""

import pytest
import torch

from grpolab.rollout.remote.parts import contiguous_parts, draw_header, merge_parts
from grpolab.rollout.sampler import SamplingSettings


@pytest.mark.parametrize(("n", "k"), [(8, 1), (8, 3), (7, 2), (2, 5), (1, 1), (12, 4)])
def test_parts_cover_every_row_once_in_order_and_differ_by_at_most_one(n, k):
    parts = contiguous_parts(n, k)
    assert [i for p in parts for i in p] == list(range(n))
    assert len(parts) == min(n, k) and all(parts)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def _answer(rows, p_len, c_len, pad, with_entropy=True):
    """One worker's six tensors for ``rows``: prompts left-padded to ``p_len``, completions right-padded to ``c_len``;
    every real value is the row's index + 1 (so a misplaced row shows)."""
    r = torch.tensor(rows)[:, None] + 1
    return [
        torch.cat([torch.full((len(rows), 1), pad), r.expand(-1, p_len - 1)], 1),
        torch.cat([torch.zeros(len(rows), 1, dtype=torch.long), torch.ones(len(rows), p_len - 1, dtype=torch.long)], 1),
        r.expand(-1, c_len).clone(),
        torch.ones(len(rows), c_len, dtype=torch.long),
        r.expand(-1, c_len).float(),
        r.expand(-1, c_len).float() if with_entropy else None,
    ]


@pytest.mark.parametrize("with_entropy", [True, False])
def test_merge_puts_rows_in_the_call_s_order_padded_as_one_draw(with_entropy):
    pad = 0
    a = ([0, 1, 2], _answer([0, 1, 2], 4, 3, pad, with_entropy))
    b = ([3, 4], _answer([3, 4], 2, 5, pad, with_entropy))
    out = merge_parts(5, [a, b], pad)
    ids, mask, comp, cmask = out.batch.tensors
    assert ids.shape == (5, 4) and comp.shape == (5, 5)
    # prompts left-padded to the widest part's P, completions right-padded to its T
    assert ids[3].tolist() == [0, 0, 0, 4] and mask[3].tolist() == [0, 0, 0, 1]
    assert ids[0].tolist() == [0, 1, 1, 1] and mask[0].tolist() == [0, 1, 1, 1]
    assert comp[1].tolist() == [2, 2, 2, 0, 0] and cmask[1].tolist() == [1, 1, 1, 0, 0]
    assert comp[4].tolist() == [5] * 5
    assert out.logprobs[2].tolist() == [3.0, 3.0, 3.0, 0.0, 0.0]
    assert (out.entropy is None) == (not with_entropy)


def test_each_part_s_request_is_padded_to_the_whole_call_s_prompt_width():
    prompts, keys = [[1], [2, 3, 4], [5, 6]], [(0, 0), (0, 1), (0, 2)]
    header = draw_header((3, prompts, keys, SamplingSettings(8, 0.7)), [0, 2], digest=True)
    assert header["prompts"] == [[1], [5, 6]] and header["keys"] == [[0, 0], [0, 2]]
    assert header["settings"]["prompt_width"] == 3 and header["version"] == 3 and header["digest"] is True
