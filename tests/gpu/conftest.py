"""Shared by the GPU tests: scripts/gpu_check.py (the megakernel-vs-pyvm rig) loaded as a module."""
import importlib.util
import pathlib

import pytest


@pytest.fixture(scope="session")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", pathlib.Path(__file__).parents[2] / "scripts/gpu_check.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m
