"""The compute boundary is one typed protocol: the real shard and every fake implement it exactly."""

import inspect

import pytest

import fakes
from meshws.model.backend import ShardBackend
from meshws.model.shard import ModelShard

FAKES = [fakes.FakeBackend, fakes.CachedHeadBackend, fakes.CachedTailBackend, fakes.BrokenTailBackend,
         fakes.LoopTailBackend, fakes.LegacyTailBackend]
METHODS = [name for name, member in vars(ShardBackend).items()
           if callable(member) and not name.startswith("_")]


def _signature(cls, name):
    return [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]


@pytest.mark.parametrize("cls", [ModelShard, *FAKES], ids=lambda cls: cls.__name__)
def test_every_protocol_method_has_the_protocol_signature(cls):
    assert len(METHODS) >= 8
    for name in METHODS:
        assert _signature(cls, name) == _signature(ShardBackend, name), f"{cls.__name__}.{name} drifted"


@pytest.mark.parametrize("cls", FAKES, ids=lambda cls: cls.__name__)
def test_fakes_have_every_protocol_attribute(cls):
    backend = cls() if cls not in (fakes.CachedTailBackend, fakes.BrokenTailBackend) else cls([])
    assert isinstance(backend, ShardBackend)
    for name in ShardBackend.__annotations__:
        assert hasattr(backend, name), f"{cls.__name__} lacks {name}"


@pytest.mark.real_model
def test_the_model_shard_has_every_protocol_attribute(embedded_model):
    shard = ModelShard(embedded_model, 15, 30)
    assert isinstance(shard, ShardBackend)
    for name in ShardBackend.__annotations__:
        assert hasattr(shard, name), f"ModelShard lacks {name}"
