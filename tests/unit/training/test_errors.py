"""The training floor's errors (lightning_pat.training.errors): one prefix, one configuration error type."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_pat.training.errors import WHO, ConfigurationError, prefixed

TRAINING = Path(__file__).resolve().parents[3] / "lightning_pat" / "training"


def test_prefixed_turns_a_value_error_into_a_configuration_error_with_the_prefix():
    match = r"^CoupledPruningCallback\(score='taylor'\): no gradient$"
    with pytest.raises(ConfigurationError, match=match) as info, prefixed(f"{WHO}(score='taylor')"):
        raise ValueError("no gradient")
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still catch it
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(TypeError, match="not a value error"), prefixed(WHO):
        raise TypeError("not a value error")  # only ValueError is the configuration's


def test_the_lightning_free_training_modules_spell_the_callback_only_through_who():
    """No string literal of the Lightning-free modules names the callback itself (docstrings and doctests aside)."""
    spelled = []
    for path in sorted(TRAINING.rglob("*.py")):
        if path.name in ("callback.py", "recipes.py", "errors.py", "collectors.py"):  # Lightning's face; WHO itself
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            literal = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            if literal and "CoupledPruningCallback" in node.value:
                spelled.append(f"{path.relative_to(TRAINING)}:{node.lineno}")
    assert not spelled, spelled
