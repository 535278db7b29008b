"""The vocab-parallel LM head split: every rank must get rows (its argmax has nothing to reduce otherwise)."""
import pytest

from mpk_runtime.ir import shard_for
from mpk_runtime.models import ConfigError, ModelConfig


@pytest.mark.parametrize("vocab,tp", [(49, 8), (5, 4), (3, 4)])
def test_a_split_that_leaves_a_rank_no_vocabulary_is_refused(vocab, tp):
    """ceil(49 / 8) = 7 rows a rank leave rank 7 none; its argmax then failed mid-generation ("max(): Expected
    reduction dim 1 to have non-zero size") instead of the LLM refusing the tp."""
    cfg = ModelConfig.from_name("tiny-llama").replace(vocab_size=vocab)
    with pytest.raises(ConfigError, match=f"cannot be split {tp} ways.*no LM head rows"):
        shard_for(cfg, tp, 0)


def test_an_uneven_vocabulary_that_leaves_every_rank_rows_is_accepted():
    cfg = ModelConfig.from_name("tiny-llama").replace(vocab_size=50)
    shards = [shard_for(cfg, 8, r) for r in range(8)]
    assert sum(s.n_vocab for s in shards) == 50 and min(s.n_vocab for s in shards) >= 1
