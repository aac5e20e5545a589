"""Static checks of an edited train.py: it must not take over what the controller and prepare.py own.

Careless or over-eager edits are caught before any training time is spent: redefining the harness's
constants or functions, patching the prepare module, seeding on its own, reading the controller's
environment, or touching the validation data. A check only fires for what the edit introduced: anything the
baseline train.py already did (e.g. an upstream checkout's own `torch.manual_seed(42)`) is left alone.
"""

from __future__ import annotations

import ast

HARNESS = {
    "SEED",
    "TIME_BUDGET",
    "EVAL_TOKENS",
    "MAX_SEQ_LEN",
    "VOCAB_SIZE",
    "evaluate_bpb",
    "make_dataloader",
    "get_token_bytes",
    "Tokenizer",
    "evaluate_holdout_bpb",
    "save_eval_artifact",
}
INTERNALS = {
    "_evaluate_split_bpb",
    "_document_batches",
    "_split_files",
    "DATA_DIR",
    "MANIFEST_PATH",
    "load_manifest",
    "evaluate_artifact",
    "HARNESS_NAMES",
}
SEED_CALLS = {"manual_seed", "manual_seed_all", "seed", "set_seed", "default_rng", "seed_everything"}
VALIDATION_STRINGS = {"val", "holdout", "val.parquet", "holdout.parquet", "validation"}
CONTROLLER_ENV = {
    "AUTOLOOP_SEED",
    "AUTOLOOP_TIME_BUDGET",
    "AUTOLOOP_EVAL_ARTIFACT",
    "AUTOLOOP_CACHE",
    "AUTOLOOP_PROFILE",
    "AUTOLOOP_DATASET",
}


def _names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _names(elt)]
    return []


def violations(source: str) -> set[str]:
    """Every way this train.py reaches into what it does not own (a set of readable reasons)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()  # the compile check reports it
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in _names(target):
                    if name in HARNESS:
                        found.add(f"train.py redefines {name}, which prepare.py owns")
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "prepare"
                ):
                    found.add(f"train.py patches prepare.{target.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in HARNESS:
            found.add(f"train.py redefines {node.name}, which prepare.py owns")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "setattr" and node.args and getattr(node.args[0], "id", "") == "prepare":
                found.add("train.py patches the prepare module with setattr")
            if name in SEED_CALLS and not (len(node.args) == 1 and getattr(node.args[0], "id", "") == "SEED"):
                if not (name == "seed" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "gc"):
                    found.add(f"train.py seeds on its own ({ast.unparse(node)[:60]}); the seed is SEED from prepare.py")
        elif isinstance(node, ast.Name) and node.id in INTERNALS:
            found.add(f"train.py uses the harness internal {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            found.add(f"train.py uses the harness internal {node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in CONTROLLER_ENV:
                found.add(f"train.py reads the controller's setting {node.value}")
            if node.value in VALIDATION_STRINGS or node.value.endswith(("val.parquet", "holdout.parquet")):
                found.add(f"train.py refers to the validation data ({node.value!r})")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name in INTERNALS:
                    found.add(f"train.py imports the harness internal {alias.name}")
    return found


def new_violations(source: str, baseline: str) -> list[str]:
    """What this edit introduced, compared with the session's baseline train.py."""
    return sorted(violations(source) - violations(baseline))
