"""FR-Spec draft vocabulary data (model/draft_vocab.py): ranking, loading, the shipped file of the tiny model."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from model import draft_vocab
from model.params import random_params

TINY = draft_vocab.Path(__file__).resolve().parents[2] / "model" / "embedded" / "tiny"


def test_rank_by_count_then_id():
    assert draft_vocab.rank(Counter({3: 5, 1: 5, 0: 2}), 5) == [1, 3, 0, 2, 4]


def test_build_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draft_vocab.build(Counter({7: 1}), 5, "test")


def test_load_takes_the_most_frequent_ascending(tmp_path):
    d = draft_vocab.build(Counter({9: 10, 2: 8, 5: 8, 0: 1}), 12, "test")
    (tmp_path / draft_vocab.FILE).write_text(json.dumps(d))
    ids = draft_vocab.load(tmp_path, 4, 12, 2)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 2, 5, 9]
    with pytest.raises(ValueError, match="multiple"):
        draft_vocab.load(tmp_path, 3, 12, 2)
    with pytest.raises(ValueError, match=r"\[1, 12\]"):
        draft_vocab.load(tmp_path, 14, 12, 2)
    with pytest.raises(ValueError, match="vocabulary"):
        draft_vocab.load(tmp_path, 4, 16, 2)
    with pytest.raises(ValueError, match="not found"):
        draft_vocab.load(tmp_path / "missing", 4, 12, 2)


def test_shipped_tiny_file_ranks_the_training_text():
    d = json.loads((TINY / draft_vocab.FILE).read_text())
    assert d["vocab_size"] == 272 and sorted(d["ids"]) == list(range(272))
    assert all(a >= b for a, b in zip(d["counts"], d["counts"][1:])) and d["tokens_counted"] > 10_000_000
    assert d["ids"][0] == ord(" ") and "training text" in d["source"]     # Python source: the space leads
    assert set(draft_vocab.load(TINY, 64, 272, 8)) <= set(range(256))   # the 64 most frequent are bytes


def test_draft_head_rows_are_the_lm_head_rows(tiny_cfg):
    params = random_params(tiny_cfg, seed=0, dtype=torch.float32)
    ids = np.array([1, 4, 9, 30, 31, 100, 200, 271], np.int32)
    from model.tp.embed_head import lm_head_weight
    w = lm_head_weight(params, tiny_cfg)
    rows = torch.cat([draft_vocab.draft_head_rows(params, tiny_cfg, ids, p, 4) for p in range(4)])
    assert torch.equal(rows, w[torch.as_tensor(ids, dtype=torch.long)])


@pytest.mark.parametrize("extra,needle", [(["--draft-vocab", "60"], "multiple"),
                                          (["--draft-vocab", "64", "--no-spec"], "needs speculation"),
                                          (["--draft-vocab", "1000"], "[1, 272]")])
def test_decode_cli_refuses_a_bad_draft_vocab(capsys, extra, needle):
    from harness import decode
    code = decode.main(["--variant", "xla", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0]
