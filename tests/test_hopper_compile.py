"""The Triton kernels the CPU tests ran in the interpreter compile for a Hopper GPU
(hopper_compile.py): this test runs after every other test of the session and compiles each
distinct launch they made."""

from __future__ import annotations

import pytest
from conftest import CUDA
from hopper_compile import compile_for_hopper, recorded_launches


@pytest.mark.compiles_launches
@pytest.mark.skipif(CUDA, reason="with a GPU the kernels compile as the tests launch them")
def test_every_kernel_the_tests_launched_compiles_for_hopper() -> None:
    launches = recorded_launches()
    if not launches:
        pytest.skip("no Triton kernel was launched in this session")
    assert compile_for_hopper(launches) == []
