"""The training engine's side of the one batch check per request: it checks every batch unless the service already
checked it against limits that cover the engine's (needs the engine modules, so not in the thin client's tests)."""

from types import SimpleNamespace

import pytest
import torch
from batch_helpers import small_batch

from arctic_rl.batch import check_batch
from arctic_rl.errors import BatchValidationError


def test_an_engine_checks_every_batch_its_limits_are_not_covered_for() -> None:
    from arctic_rl.engines.deepspeed_base import DeepSpeedModelEngine

    engine = SimpleNamespace(vocab_size=10, max_positions=8, device=torch.device("cpu"))
    out_of_vocabulary = small_batch()
    out_of_vocabulary["responses"][0, 0] = 9
    out_of_vocabulary["input_ids"][0, 3] = 9
    checked_for_a_larger_vocabulary = check_batch(out_of_vocabulary, vocab_size=12, require=(), max_length=8)
    # The same message a plain batch gets: the engine's own check ran.
    for batch in (out_of_vocabulary, checked_for_a_larger_vocabulary):
        with pytest.raises(BatchValidationError, match=r"outside the model's vocabulary \[0, 9\)"):
            DeepSpeedModelEngine._validate(
                SimpleNamespace(vocab_size=9, max_positions=8, device=torch.device("cpu")),
                batch,
                require=(),
            )
    # A batch the service checked against these limits is taken as checked (the one check of the request): the
    # tensors come back as they were, not copies made by a second validation.
    covered = check_batch(small_batch(), vocab_size=10, require=("advantages",), max_length=8).select([0, 1])
    taken = DeepSpeedModelEngine._validate(engine, covered, require=("advantages",))
    assert all(taken[key] is covered[key] for key in covered)
    # A plain dict with the same content is validated (and so copied into fresh tensors).
    plain = dict(covered)
    validated = DeepSpeedModelEngine._validate(engine, plain, require=("advantages",))
    assert not any(validated[key] is plain[key] for key in ("input_ids", "responses"))
    with pytest.raises(BatchValidationError, match="ref_log_prob"):
        DeepSpeedModelEngine._validate(engine, covered, require=("advantages", "ref_log_prob"))
