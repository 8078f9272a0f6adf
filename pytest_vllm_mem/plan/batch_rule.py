"""vLLM's batch-default rule read from the installed vLLM's own source, where it can be read; else batch_defaults.

`EngineArgs.get_batch_defaults` (vllm/engine/arg_utils.py) picks max_num_batched_tokens and max_num_seqs for
`vllm serve` from the device's total memory and name: an if/elif chain over `device_memory >= N * GiB_bytes`
(and `"a100" not in device_name`), each branch assigning `{UsageContext.OPENAI_API_SERVER: value, ...}`. Reading
that chain from the source (with `ast`, nothing imported or run) follows a release that moves a threshold or adds a
branch; a source that does not have that shape gives None and the caller uses the table in batch_defaults. Pure:
the caller reads the file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from pytest_vllm_mem.plan.batch_defaults import BatchDefaults, batch_defaults, no_nvml_memory
from pytest_vllm_mem.units import GIB

__all__ = ["BatchBranch", "BatchRule", "defaults_for", "rule_from_source"]

_FUNCTION = "get_batch_defaults"
_CONTEXT = "OPENAI_API_SERVER"


@dataclass(frozen=True)
class BatchBranch:
    min_bytes: int  # the branch applies to devices of at least this many bytes (0: the else branch)
    excluded_names: tuple[str, ...]  # ... whose lower-cased name contains none of these
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class BatchRule:
    branches: tuple[BatchBranch, ...]  # in the source's order; the first that applies wins
    source: str  # where it was read, for notes

    def defaults(self, device_bytes: int, device_name: str = "") -> BatchDefaults:
        name = device_name.lower()
        for branch in self.branches:
            if device_bytes >= branch.min_bytes and not any(word in name for word in branch.excluded_names):
                why = f">= {branch.min_bytes / GIB:g} GiB" if branch.min_bytes else "the smaller devices' branch"
                return BatchDefaults(
                    branch.max_num_batched_tokens, branch.max_num_seqs, f"{why}, read from {self.source}"
                )
        raise AssertionError("a rule always ends with its else branch")


def defaults_for(
    device_bytes: int, device_name: str, rule: BatchRule | None, *, vllm_version: str | None = None
) -> BatchDefaults:
    """vLLM's serve defaults on a device of `device_bytes`: from `rule` (the installed vLLM's source) if it was
    read, else from the table in batch_defaults (by release)."""
    if rule is not None:  # a GB10 reaches the rule with no memory total before 0.33 (batch_defaults' docstring)
        return rule.defaults(0 if no_nvml_memory(device_name) else device_bytes, device_name)
    return batch_defaults(device_bytes, device_name, vllm_version=vllm_version)


def rule_from_source(text: str, source: str = "vllm/engine/arg_utils.py") -> BatchRule | None:
    """The rule of get_batch_defaults in arg_utils.py's text; None when the source does not have the known shape."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == _FUNCTION:
            chain = next((stmt for stmt in node.body if isinstance(stmt, ast.If) and _threshold(stmt.test)), None)
            return _chain(chain, source) if chain is not None else None
    return None


def _chain(node: ast.If, source: str) -> BatchRule | None:
    branches: list[BatchBranch] = []
    current: ast.If | None = node
    while current is not None:
        threshold = _threshold(current.test)
        values = _values(current.body)
        if threshold is None or values is None:
            return None
        branches.append(BatchBranch(threshold[0], threshold[1], *values))
        if len(current.orelse) == 1 and isinstance(current.orelse[0], ast.If):
            current = current.orelse[0]
            continue
        tail = _values(current.orelse)
        if tail is None:
            return None
        branches.append(BatchBranch(0, (), *tail))
        current = None
    return BatchRule(tuple(branches), source)


def _threshold(test: ast.expr) -> tuple[int, tuple[str, ...]] | None:
    """`device_memory >= N * GiB_bytes [and "x" not in device_name ...]` -> (N GiB, ("x", ...))."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    minimum: int | None = None
    excluded: list[str] = []
    for part in parts:
        # 0.33: `and not is_gb10` (compute capability 12.1, DGX Spark's GB10: the memory of a large GPU, not its
        # compute). NVML gives names, not capabilities here: the name "NVIDIA GB10" stands for it.
        if isinstance(part, ast.UnaryOp) and isinstance(part.op, ast.Not) and isinstance(part.operand, ast.Name):
            if part.operand.id.startswith("is_"):
                excluded.append(part.operand.id[len("is_") :].lower())
                continue
            return None
        if not isinstance(part, ast.Compare) or len(part.ops) != 1:
            return None
        left, op, right = part.left, part.ops[0], part.comparators[0]
        if isinstance(op, ast.GtE) and isinstance(left, ast.Name) and left.id == "device_memory":
            if (
                isinstance(right, ast.BinOp)
                and isinstance(right.op, ast.Mult)
                and isinstance(right.left, ast.Constant)
                and isinstance(right.left.value, (int, float))
                and isinstance(right.right, ast.Name)
                and right.right.id == "GiB_bytes"
            ):
                minimum = int(right.left.value * GIB)
                continue
            return None
        if isinstance(op, ast.NotIn) and isinstance(left, ast.Constant) and isinstance(left.value, str):
            excluded.append(left.value.lower())
            continue
        return None
    return (minimum, tuple(excluded)) if minimum is not None else None


def _values(body: list[ast.stmt]) -> tuple[int, int] | None:
    """The OPENAI_API_SERVER entries of the two dicts a branch assigns."""
    found: dict[str, int] = {}
    for stmt in body:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or not isinstance(stmt.value, ast.Dict):
            continue
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        if not isinstance(target, ast.Name):
            continue
        for key, value in zip(stmt.value.keys, stmt.value.values):
            if (
                isinstance(key, ast.Attribute)
                and key.attr == _CONTEXT
                and isinstance(value, ast.Constant)
                and isinstance(value.value, int)
            ):
                found[target.id] = value.value
    tokens, seqs = found.get("default_max_num_batched_tokens"), found.get("default_max_num_seqs")
    return (tokens, seqs) if tokens is not None and seqs is not None else None
