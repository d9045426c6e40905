import pickle

import pytest

from arctic_rl.errors import (
    ArcticRLError,
    BatchValidationError,
    ConfigError,
    EngineError,
    EngineStateError,
    MissingDependencyError,
    TransportError,
    WireFormatError,
    import_optional,
)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("bad"),
        BatchValidationError("advantages", "has NaN"),
        EngineError("training[0]", "died"),
        EngineStateError("sleeping", engine="sampling[1]"),
        EngineStateError("sleeping"),
        MissingDependencyError("vllm", "vllm", "by the sampling engine"),
        WireFormatError("not a wire message"),
        TransportError("server unreachable"),
    ],
)
def test_errors_pickle_unchanged_across_processes(error: ArcticRLError) -> None:
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is type(error)
    assert str(restored) == str(error)
    assert restored.__dict__ == error.__dict__
    assert isinstance(restored, ArcticRLError)


def test_messages_name_what_failed() -> None:
    assert str(BatchValidationError("advantages", "has NaN")) == "batch['advantages']: has NaN"
    assert str(EngineError("training[0]", "died")) == "training[0] engine: died"
    assert str(EngineStateError("fwd_bwd while sleeping", engine="training[0]")).startswith("training[0] engine:")
    assert isinstance(ConfigError("x"), ValueError)
    assert isinstance(BatchValidationError("k", "m"), ValueError)
    assert isinstance(EngineError("e", "m"), RuntimeError)


def test_import_optional_names_the_extra() -> None:
    assert import_optional("json", extra="engines").dumps(1) == "1"
    with pytest.raises(MissingDependencyError, match=r"pip install 'arctic-rl\[engines\]'") as raised:
        import_optional("surely_not_installed_module.sub", extra="engines", purpose="by the test")
    assert raised.value.package == "surely_not_installed_module"
    assert isinstance(raised.value, ImportError)
