"""Fixtures the system tests share: the float32 head + tail most of them talk to."""

import pytest

from helpers import EXACT
from meshws.tools.launch import Mesh


@pytest.fixture(scope="module")
def mesh(embedded_model):
    """A head (layers 0-14) and a tail (15-29) computing in float32, one pair per test module; a module that
    needs other flags defines its own `mesh`."""
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=EXACT)
    yield mesh
    mesh.stop()
