"""
evaluate.py -- the FIXED evaluation of autoloop: the number that counts. Never edited by the loop.

The controller runs it after every experiment, in a process of its own that never runs train.py's code:

    python -I -S evaluate.py MODEL --split val --result FILE      # the nonce comes on stdin

MODEL is the graph train.py exported through prepare.evaluate_bpb (torch.export: ATen operations and raw
weights, no Python). This file reads that archive itself (never a pickle, a guard or a symbolic expression),
runs only pure, deterministic ATen operations, scores validation bits per byte on the pinned split with
prepare.py's data and tokenizer, and checks what a graph could still cheat with (probes, below): each position
must be predicted from its past alone, each row on its own, and the same way every time.

`-I -S`: nothing the run left in the worktree (a `json.py`, a `torch/`) is on the import path, and no site hook
(`.pth`, `sitecustomize`, `usercustomize`) runs; the package directories are added here, by name. prepare.py is
loaded from beside this file. The controller checks this file's hash, like prepare.py's, before every run.
"""

import os
import sys

if __name__ == "__main__" and sys.platform.startswith("linux") and "GLIBC_TUNABLES" not in os.environ:
    # As in train.py: keep freed tensor memory in the heap instead of a fresh mmap (and page faults) for every
    # large activation, measured ~1.7x faster evaluation on a 2-core CPU. Re-exec so the allocator sees it.
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _package_dirs():
    """This Python's site-packages, found as site.py finds them (a virtual environment's pyvenv.cfg included)
    but without running any .pth file or customize module in them."""
    import site

    prefixes = [sys.prefix, sys.exec_prefix]
    here = os.path.dirname(sys.executable)  # not resolved: a venv's python is a link to the base one
    for cfg in (os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")):
        if os.path.isfile(cfg):
            with open(cfg) as f:
                shared = any(line.replace(" ", "").lower() == "include-system-site-packages=true" for line in
                             f.read().splitlines())
            prefixes = [os.path.dirname(cfg), *(prefixes if shared else [])]
            break
    return [d for d in site.getsitepackages(prefixes) if os.path.isdir(d)]


if sys.flags.no_site:  # python -S (as the controller starts it): the packages by name, no hook of theirs run
    sys.path.extend(d for d in _package_dirs() if d not in sys.path)


def _load_prepare():
    """prepare.py, from beside this file (under -I the script's directory is not on the import path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare.py")
    loaded = sys.modules.get("prepare")
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        return loaded
    spec = importlib.util.spec_from_file_location("prepare", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare"] = module
    spec.loader.exec_module(module)
    return module


import argparse
import hashlib
import io
import json
import math
import pickle
import re
import time
import zipfile

import torch

prepare = _load_prepare()
MAX_SEQ_LEN, EVAL_ROWS = prepare.MAX_SEQ_LEN, prepare.EVAL_ROWS

# ---------------------------------------------------------------------------
# What a graph may do
# ---------------------------------------------------------------------------
# torch.export.load unpickles parts of the archive and evaluates strings (guards, symbolic shapes) from it: a
# file the run wrote could run code in the evaluator. So the archive is read here: JSON and raw weight bytes only,
# static shapes, no guards, no subgraphs or custom objects, and only the pure, deterministic ATen operations below.

EVAL_OPS = set("""
abs add addmm alias all amax amin any arange argmax argmin atan atan2 baddbmm bitwise_and bitwise_not bitwise_or
bitwise_xor bmm cat ceil chunk clamp clamp_max clamp_min clone constant_pad_nd contiguous cos cosh cumsum detach
diagonal div elu embedding eq erf exp expand expand_as expm1 flatten flip floor fmod full full_like gather ge gelu
group_norm gt hardtanh index index_select layer_norm le leaky_relu lerp lift_fresh_copy linear log log1p log2
log_softmax logical_and logical_not logical_or logsumexp lt masked_fill matmul max maximum mean min minimum mish
mm mul native_layer_norm ne neg norm linalg_vector_norm ones ones_like outer permute pow prod reciprocal relu
remainder repeat repeat_interleave reshape rms_norm roll round rsqrt scalar_tensor scaled_dot_product_attention
scatter scatter_add select sigmoid sign silu sin sinh slice softmax softplus split split_with_sizes sqrt square
squeeze stack std sub sum t tanh tensor_split tile to topk sort transpose tril triu trunc type_as unbind unflatten
unsqueeze var view view_as where zeros zeros_like _assert_tensor_metadata _log_softmax _softmax _to_copy
_unsafe_view __and__ __or__ __xor__ __invert__
""".split())
EVAL_MAX_NODES = 50_000  # operations in a graph (a GPT of depth 32 has a few thousand)
EVAL_MAX_ELEMENTS_SHARE = 8  # any value the graph computes holds at most this many logits' worth of elements
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FORBIDDEN_KEYS = {"as_expr", "expr_str", "as_graph", "as_custom_obj", "as_operator", "as_sym_int", "as_sym_ints",
                   "as_sym_float", "as_sym_floats", "as_sym_bool", "as_sym_bools", "as_complex"}

# ---------------------------------------------------------------------------
# Probes: rows sampled from the whole evaluation, each run again with a changed future
# ---------------------------------------------------------------------------
# A graph that peeks at the next token scores better only where the token it peeks at is the true one. So a probe
# takes an evaluation row, cuts it at a random position c, replaces every token after c with another row's, and
# runs it again (its rows shuffled, after all the scoring): up to c nothing the row's predictions depend on has
# changed. At c, the log-probability of the true next token may be higher in the scoring pass only by kernel
# noise, and on average not at all: the signed test below bounds what any cheat gains on average, wherever it
# cheats, to EVAL_PROBE_Z noise standard errors. A cheat on a share G of the positions that moves a prediction by
# more than EVAL_PROBE_ATOL is caught by each probed row with probability G: it passes n probes with
# probability (1 - G)^n. Before c the row is the same in both passes: what moves there is noise (kernels that
# order their sums differently for another batch) or a model that lets rows see each other or keeps state. No cut
# reaches the last position (its target is never in the input), so a share of the probed rows also runs again
# whole, in other batches: there every position, the last one too, must come back as it was scored.
EVAL_PROBE_SHARE = 8  # one evaluation row in this many is probed ...
EVAL_MIN_PROBE_ROWS = 64  # ... and at least this many (all of them in a smaller evaluation)
EVAL_PROBE_WHOLE_SHARE = 4  # one probed row in this many also runs again whole: its last position is compared too
EVAL_PROBE_Z = 5.0  # the signed test: refused when the true token's mean gain at the cuts exceeds Z standard errors
EVAL_PROBE_MIN_SE = 1e-6  # nats: the standard error assumed at least (fp32 rounding where kernels are exact)
# Measured on honest models (benchmarks/probe_noise.py; docs/trust.md): on a CPU an fp32 or bf16 model is mostly
# exact, loaded or not, and moved at most 1.1e-3 nats; accelerators' kernels may order their sums by the batch.
EVAL_PROBE_ATOL = {"cpu": 0.02, "gpu": 0.1}  # nats a log-probability may move at any probed position
EVAL_PROBE_RMS = {"cpu": 2e-3, "gpu": 1e-2}  # nats: the root mean square of those moves, at most


class ArtifactRefused(Exception):
    """The saved model is not a plain exported graph the harness can evaluate without running the run's code."""


def _walk(node, path=""):
    """Every (key path, key, value) of a JSON document."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def _check_program(program):
    """Refuse what torch's deserializer would execute and what the harness does not evaluate (each node's
    operation is checked where the graph is built: _operation)."""
    if program.get("range_constraints") or program.get("guards_code"):
        raise ArtifactRefused("the graph has symbolic shapes or guards; export with static shapes")
    for path, key, value in _walk(program):
        if key in _FORBIDDEN_KEYS:
            raise ArtifactRefused(f"the graph holds {key.removeprefix('as_')} values ({path}); only tensors of fixed "
                                  "shape and plain constants are evaluated")
        if key == "name" and isinstance(value, str) and not _IDENTIFIER.match(value):
            raise ArtifactRefused(f"a value with an unusable name ({value[:40]!r})")
        if key in ("parameter_name", "buffer_name", "tensor_constant_name", "fqn") and isinstance(value, str):
            if value and not all(_IDENTIFIER.match(p) or p.isdigit() for p in value.split(".")) or "__" in value:
                raise ArtifactRefused(f"an unusable parameter or module name ({value[:40]!r})")
    module = program["graph_module"]
    graph = module["graph"]
    if any(graph.get(k) for k in ("sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values")):
        raise ArtifactRefused("the graph has symbolic or custom values; export with static shapes")
    if module.get("treespec_namedtuple_fields"):
        raise ArtifactRefused("the model returns named tuples; return one tensor of logits")
    if set(program.get("verifiers") or []) - {"TRAINING", "ATEN"}:
        raise ArtifactRefused(f"an unknown graph dialect {program['verifiers']}")


# Serialized enums of torch.export's schema (torch/_export/serde/schema.py), the ones a model's graph uses
_DTYPES = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float16,
           7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16}
_STRIDED, _MEMORY_FORMATS = 7, {1: torch.contiguous_format, 4: torch.preserve_format}
_LITERALS = {"as_int", "as_float", "as_bool", "as_string", "as_ints", "as_floats", "as_bools", "as_strings"}


def _read_payload(archive, directory, config_name, kind):
    """Tensors stored as raw bytes (never pickles), each checked against the shape and dtype it declares."""
    tensors = {}
    config = json.loads(archive.read(directory + config_name))["config"]
    for fqn, meta in config.items():
        tm = meta.get("tensor_meta") or {}
        path = str(meta.get("path_name", ""))
        if meta.get("use_pickle") or not re.fullmatch(r"(weight|tensor)_\d+", path) or tm.get("dtype") not in _DTYPES \
                or tm.get("layout", _STRIDED) != _STRIDED:
            raise ArtifactRefused(f"{kind} {fqn!r} is not a plain tensor (pickled objects are not loaded)")
        try:
            sizes, strides = [s["as_int"] for s in tm["sizes"]], [s["as_int"] for s in tm["strides"]]
            offset = tm["storage_offset"]["as_int"]
        except (KeyError, TypeError):
            raise ArtifactRefused(f"{kind} {fqn!r} has a symbolic shape") from None
        if not all(type(v) is int for v in [*sizes, *strides, offset]):
            raise ArtifactRefused(f"{kind} {fqn!r} has a malformed shape")
        data = bytearray(archive.read(directory + path))
        dtype = _DTYPES[tm["dtype"]]
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.zeros(0, dtype=dtype)
        if math.prod(sizes) > flat.numel() or any(s > 1 and st == 0 for s, st in zip(sizes, strides)):
            # a weight declared far larger than its bytes (stride 0 over one element) costs nothing to store and
            # time to compute with: a saved weight has no use for a repeated element
            raise ArtifactRefused(f"{kind} {fqn!r} declares {math.prod(sizes)} elements over {flat.numel()} stored "
                                  "ones; save every element of a weight")
        try:
            tensors[fqn] = torch.as_strided(flat, sizes, strides, offset)
        except RuntimeError as e:
            raise ArtifactRefused(f"{kind} {fqn!r} does not fit its data ({str(e)[:80]})") from None
    return tensors


class _Ref:
    """A value of the graph, by name."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _decode(arg, device):
    """A serialized argument as a Python value (a _Ref for a tensor of the graph). Anything else is refused."""
    if not isinstance(arg, dict) or len(arg) != 1:
        raise ArtifactRefused("a malformed argument")
    (tag, value), = arg.items()
    if tag == "as_tensor":
        return _Ref(value["name"])
    if tag == "as_tensors":
        return [_Ref(v["name"]) for v in value]
    if tag == "as_optional_tensors":
        return [None if "as_none" in v else _Ref(v["as_tensor"]["name"]) for v in value]
    if tag == "as_none":
        return None
    if tag in _LITERALS:
        return value
    if tag == "as_scalar_type" and value in _DTYPES:
        return _DTYPES[value]
    if tag == "as_device":
        return device  # the evaluation's device, whatever the run's was
    if tag == "as_layout" and value == _STRIDED:
        return torch.strided
    if tag == "as_memory_format" and value in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[value]
    raise ArtifactRefused(f"an argument of an unsupported kind ({tag})")


def _operation(target):
    """The allowed ATen operation a node calls: pure and deterministic (attention: dropout checked per node)."""
    parts = str(target).split(".")
    if len(parts) != 5 or parts[:3] != ["torch", "ops", "aten"] or parts[3] not in EVAL_OPS \
            or not _IDENTIFIER.match(parts[4]):
        raise ArtifactRefused(f"the graph uses {str(target)[:80]!r}, which is not among the ATen operations the "
                              "harness evaluates (pure and deterministic; no random, in-place or custom ones)")
    try:
        op = getattr(getattr(torch.ops.aten, parts[3]), parts[4])
    except AttributeError:
        raise ArtifactRefused(f"the graph uses {target!r}, which this torch does not have") from None
    attention = parts[3] == "scaled_dot_product_attention"
    if op._schema.is_mutable or (torch.Tag.nondeterministic_seeded in op.tags and not attention):
        raise ArtifactRefused(f"the graph uses {op}, which mutates or draws random numbers")
    return op


def _names(values):
    """The names of the graph values that `values` (decoded arguments or outputs) refer to."""
    for value in values:
        if isinstance(value, _Ref):
            yield value.name
        elif isinstance(value, list):
            yield from _names(value)


class ExportedGraph:
    """An exported graph run by the harness itself: each node an allowed ATen operation called on decoded
    arguments, in order. Nothing from the archive is executed but those operations (no deserializer, no
    generated code); export's dtype assertions are skipped (they pin the fp32 seen at export, and the harness
    runs the graph under the run's autocast)."""

    def __init__(self, program, weights, constants, device):
        module = program["graph_module"]
        graph, signature = module["graph"], module["signature"]
        self.values, inputs = {}, []
        for spec in signature["input_specs"]:
            (kind, body), = spec.items()
            if kind == "user_input":
                inputs.append(body["arg"]["as_tensor"]["name"])
                continue
            fqn = body.get({"parameter": "parameter_name", "buffer": "buffer_name",
                            "tensor_constant": "tensor_constant_name"}.get(kind, ""), "")
            source = weights if fqn in weights else constants
            if kind not in ("parameter", "buffer", "tensor_constant") or fqn not in source:
                raise ArtifactRefused(f"the graph takes an input of kind {kind} ({fqn or '?'}); it may take only "
                                      "its weights and the batch")
            self.values[body["arg"]["name"]] = source[fqn].to(device)
        outputs = signature["output_specs"]
        if len(inputs) != 1:
            raise ArtifactRefused(f"the model takes {len(inputs)} inputs; it must take one batch of token ids")
        if [next(iter(o)) for o in outputs] != ["user_output"] or "as_tensor" not in outputs[0]["user_output"]["arg"]:
            raise ArtifactRefused("the graph must return exactly one tensor (the logits) and mutate nothing: a buffer "
                                  "it updates would carry state from one batch to the next")
        self.input, self.output = inputs[0], outputs[0]["user_output"]["arg"]["as_tensor"]["name"]
        self.nodes = []
        if len(graph["nodes"]) > EVAL_MAX_NODES:
            raise ArtifactRefused(f"the graph has {len(graph['nodes'])} operations, more than {EVAL_MAX_NODES}")
        for node in graph["nodes"]:
            op = _operation(node.get("target"))
            if op is torch.ops.aten._assert_tensor_metadata.default:
                continue
            args, kwargs = [], {}
            for item in node["inputs"]:
                value = _decode(item["arg"], device)
                if item.get("kind") == 2:
                    kwargs[item["name"]] = value
                else:
                    args.append(value)
            if op is torch.ops.aten.scaled_dot_product_attention.default and \
                    kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) != 0.0:
                raise ArtifactRefused("the graph's attention uses dropout (random numbers); evaluate without it")
            self.nodes.append((op, args, kwargs, [_decode(o, device) for o in node["outputs"]]))
        # what each node is the last to use (or makes for no one): let go of it then, so a forward holds only
        # what is still to be used (a fifth less time on the cpu profile: the freed memory is reused hot)
        last = {}
        for i, (_, args, kwargs, outputs) in enumerate(self.nodes):
            for name in _names(outputs):
                last[name] = i
            for name in _names([*args, *kwargs.values()]):
                last[name] = i
        self.done = [[] for _ in self.nodes]
        for name, i in last.items():
            if name != self.output and name not in self.values and name != self.input:
                self.done[i].append(name)

    def _get(self, value, env):
        if isinstance(value, _Ref):
            if value.name not in env:
                raise ArtifactRefused(f"the graph uses {value.name!r} before it is computed")
            return env[value.name]
        if isinstance(value, list):
            return [self._get(v, env) for v in value]
        return value

    def __call__(self, x, max_elements):
        """The graph's output for the batch x; no value it computes may hold more than max_elements."""
        env = dict(self.values)
        env[self.input] = x
        for (op, args, kwargs, outputs), done in zip(self.nodes, self.done):
            result = op(*[self._get(a, env) for a in args], **{k: self._get(v, env) for k, v in kwargs.items()})
            for value in (result if isinstance(result, (tuple, list)) else [result]):
                if isinstance(value, torch.Tensor) and value.numel() > max_elements:
                    raise ArtifactRefused(f"{op} made a value of {value.numel()} elements, more than "
                                          f"{max_elements} ({EVAL_MAX_ELEMENTS_SHARE} times the logits)")
            if len(outputs) == 1 and isinstance(outputs[0], _Ref):
                env[outputs[0].name] = result
            else:
                flat = [o for out in outputs for o in (out if isinstance(out, list) else [out])]
                results = list(result) if isinstance(result, (tuple, list)) else [result]
                if len(results) != len(flat):
                    raise ArtifactRefused(f"{op} returned {len(results)} values, the graph names {len(flat)}")
                for out, value in zip(flat, results):
                    if isinstance(out, _Ref):
                        env[out.name] = value
            for name in done:
                env.pop(name, None)
        if self.output not in env:
            raise ArtifactRefused("the graph's output is never computed")
        return env[self.output]


def load_exported(path, device):
    """(the exported graph, ready to run on `device`, the run's notes, the input shape) read from a torch.export
    archive without executing anything from it. ArtifactRefused says why a file is not evaluated."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise ArtifactRefused(f"the saved model is not an exported program ({e}); call prepare.evaluate_bpb, which "
                              "exports it with torch.export") from None
    try:
        with archive:
            roots = [n[:-len("models/model.json")] for n in archive.namelist() if n.endswith("models/model.json")]
            if len(roots) != 1:
                raise ArtifactRefused("the saved model holds no single exported program")
            root = roots[0]
            program = json.loads(archive.read(root + "models/model.json"))
            _check_program(program)
            weights = _read_payload(archive, root + "data/weights/", "model_weights_config.json", "weight")
            constants = _read_payload(archive, root + "data/constants/", "model_constants_config.json", "constant")
            try:
                notes = json.loads(archive.read(root + "extra/autoloop.json"))
            except (KeyError, ValueError):
                notes = {}
        graph = ExportedGraph(program, weights, constants, device)
        shape = _input_shape(program, graph.input)
    except (KeyError, TypeError, ValueError, AttributeError, zipfile.BadZipFile) as e:
        raise ArtifactRefused(f"the exported program is malformed ({type(e).__name__}: {str(e)[:120]})") from None
    return graph, notes if isinstance(notes, dict) else {}, shape


def _input_shape(program, name):
    meta = program["graph_module"]["graph"]["tensor_values"].get(name) or {}
    sizes = [s.get("as_int") for s in meta.get("sizes", [])]
    if sizes != [EVAL_ROWS, MAX_SEQ_LEN] or meta.get("dtype") != 5:  # ScalarType LONG
        # the harness fixes the rows per forward, so how the evaluation is cut into batches is never the run's
        raise ArtifactRefused(f"the model was exported for input {sizes}; it must take ({EVAL_ROWS}, "
                              f"{MAX_SEQ_LEN}) int64 token ids (prepare.evaluate_bpb exports it so)")
    return tuple(sizes)




# ---------------------------------------------------------------------------
# Scoring and probing
# ---------------------------------------------------------------------------


def probe_rows(n_rows, generator):
    """The evaluation rows the probes run again: one in EVAL_PROBE_SHARE, at least EVAL_MIN_PROBE_ROWS, filling
    whole forwards of EVAL_ROWS where the evaluation has that many rows; at random, from all of them."""
    want = max(EVAL_MIN_PROBE_ROWS, -(-n_rows // EVAL_PROBE_SHARE))
    want = min(n_rows, -(-want // EVAL_ROWS) * EVAL_ROWS)
    return torch.randperm(n_rows, generator=generator)[:want]


def _forwards(rows, batch_rows):
    """(first row, rows of it that count, batch) of each forward: the last one padded with rows from the start
    (the graph takes a fixed number of rows)."""
    for start in range(0, len(rows), batch_rows):
        batch = rows[start:start + batch_rows]
        real = len(batch)
        if real < batch_rows:
            batch = torch.cat([batch, rows[:batch_rows - real]])
        yield start, real, batch


def _losses(forward, x, y, vocab):
    """Per-token cross-entropy (nats) of the graph's logits for x against the targets y, shape of y."""
    logits = forward(x)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (*x.shape, vocab) \
            or not logits.is_floating_point():
        raise ArtifactRefused(f"the model returned {type(logits).__name__} {tuple(getattr(logits, 'shape', ()))}; "
                              f"it must return logits of shape ({x.shape[0]}, {MAX_SEQ_LEN}, {vocab})")
    return _token_losses(logits.float().reshape(-1, vocab), y.reshape(-1)).view(y.shape)


def _token_losses(logits, targets):
    """Per-token cross-entropy (nats). On a CPU a few rows at a time: the same numbers as in one call (each row is
    computed on its own), nearly twice as fast, as a chunk's log-softmax stays in cache."""
    chunk = 256 if logits.device.type == "cpu" else len(targets)
    return torch.cat([torch.nn.functional.cross_entropy(logits[i:i + chunk], targets[i:i + chunk], reduction="none")
                      for i in range(0, len(targets), chunk)])


@torch.no_grad()
def score(forward, rows, wanted, vocab, token_bytes, device, keep):
    """(total nats, total bytes, {row: its per-token losses} for the rows in `keep`) over the evaluation rows,
    EVAL_ROWS per forward; exactly `wanted` target tokens count (the last row may count only in part)."""
    total_nats, total_bytes, counted, kept, wanted_rows = 0.0, 0, 0, {}, set(keep.tolist())
    for start, real, batch in _forwards(rows, EVAL_ROWS):
        batch = batch.to(device)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        losses = _losses(forward, x, y, vocab)
        take = min(real * MAX_SEQ_LEN, wanted - counted)
        nbytes = token_bytes[y.reshape(-1)[:take]]
        total_nats += (losses.reshape(-1)[:take] * (nbytes > 0)).sum().item()
        total_bytes += nbytes.sum().item()
        counted += take
        for i in range(real):
            if start + i in wanted_rows:
                kept[start + i] = losses[i].cpu()
    assert counted == wanted, (counted, wanted)
    return total_nats, total_bytes, kept


@torch.no_grad()
def probe(forward, rows, kept, picks, generator, vocab, device, kind):
    """('' or what the model did, the probes' statistics): each picked row run again after all the scoring, shuffled
    into new batches, with every token after a random cut replaced by another picked row's (a reversed copy of its
    own where there is one row); and a share of them (EVAL_PROBE_WHOLE_SHARE) once more with nothing replaced, so
    every position is compared, the last one too (no cut reaches it). Before the cuts, and everywhere in the whole
    rows, the true tokens' losses must match the scoring pass within EVAL_PROBE_ATOL[kind] and EVAL_PROBE_RMS[kind];
    at a cut the true next token's loss may not be lower in the scoring pass on average (the signed test)."""
    picks = picks[torch.randperm(len(picks), generator=generator)]
    whole = picks[: -(-len(picks) // EVAL_PROBE_WHOLE_SHARE)]
    again_rows = torch.cat([picks, whole])
    donors = torch.cat([torch.roll(picks, 1) if len(picks) > 1 else picks, whole])
    cuts = torch.cat([torch.randint(0, MAX_SEQ_LEN - 1, (len(picks),), generator=generator),
                      torch.full((len(whole),), MAX_SEQ_LEN - 1)])  # a cut at the last position replaces nothing
    order = torch.randperm(len(again_rows), generator=generator)
    again_rows, donors, cuts = again_rows[order], donors[order], cuts[order]
    at_cut, before, worst = [], [], 0.0
    for start, real, _ in _forwards(again_rows, EVAL_ROWS):
        idx = torch.arange(start, start + EVAL_ROWS) % len(again_rows)
        mine, theirs, cut = rows[again_rows[idx]], rows[donors[idx]], cuts[idx]
        if len(picks) == 1:
            theirs = mine.flip(1)
        x, y = mine[:, :-1], mine[:, 1:]
        future = torch.arange(MAX_SEQ_LEN)[None, :] > cut[:, None]
        spliced = torch.where(future, theirs[:, :-1], x)
        again = _losses(forward, spliced.contiguous().to(device), y.contiguous().to(device), vocab).cpu()
        for i in range(real):
            row, c = int(again_rows[idx[i]]), int(cut[i])
            moved = (again[i, :c + 1].clamp_max(30.0) - kept[row][:c + 1].clamp_max(30.0)).double()
            if not torch.isfinite(moved).all():
                return "the model's predictions were not finite when it ran again", {}
            worst = max(worst, moved.abs().max().item())
            if c == MAX_SEQ_LEN - 1:  # a whole row: every position the same input, so nothing may move
                before.append(moved)
            else:
                at_cut.append(moved[c].item())  # > 0: the true next token was likelier when it was in the input
                before.append(moved[:c])
    moves = torch.cat(before)
    rms = moves.square().mean().sqrt().item() if moves.numel() else 0.0
    n = len(at_cut)
    gain = sum(at_cut) / n
    se = max(rms, EVAL_PROBE_MIN_SE) / math.sqrt(n)
    stats = {"rows": n, "whole_rows": len(whole), "max_abs": worst, "rms": rms, "mean_gain_at_cut": gain,
             "z": gain / se}
    if worst > EVAL_PROBE_ATOL[kind] or rms > EVAL_PROBE_RMS[kind]:
        return (f"the model's predictions at a position changed by up to {worst:.3g} nats (root mean square "
                f"{rms:.3g}) when later tokens or other rows of the batch changed, or when it ran again: it must be "
                f"causal, score each row on its own and keep no state"), stats
    if gain > EVAL_PROBE_Z * se:
        return (f"the true next token was likelier, by {gain:.3g} nats on average over {n} probed positions "
                f"({gain / se:.1f} standard errors), when it was in the model's input: it must be causal"), stats
    return "", stats


def _verified_bytes(manifest, rel):
    """A prepared file's bytes, if they match the manifest the session pinned (read once: what is checked is
    what is used)."""
    data = (prepare.MANIFEST_PATH.parent / rel).read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["files"].get(rel):
        raise ArtifactRefused(f"the prepared file {rel} changed since it was prepared; prepare the data again")
    return data


def _evaluation_data(split):
    """(tokenizer-independent inputs of the evaluation: token bytes, rows, tokens wanted, '') or (..., why not),
    every file checked against the manifest the session pinned (AUTOLOOP_MANIFEST_DIGEST)."""
    manifest = prepare.load_manifest()
    pinned = os.environ.get("AUTOLOOP_MANIFEST_DIGEST")  # set by the controller: its session's data
    if pinned and prepare.manifest_digest(manifest) != pinned:
        return None, None, 0, ("the prepared data's manifest (evaluation sizes, file hashes) changed since the "
                               "session pinned it; an experiment may have rewritten it")
    try:
        tokenizer = prepare.Tokenizer(pickle.loads(_verified_bytes(manifest, f"{prepare.TOKENIZER_DIR.name}/"
                                                                             "tokenizer.pkl")))
        token_bytes = torch.load(io.BytesIO(_verified_bytes(manifest, f"{prepare.TOKENIZER_DIR.name}/"
                                                                      "token_bytes.pt")), weights_only=True)
        for rel in manifest["splits"][split]:
            _verified_bytes(manifest, f"data/{rel}")
        wanted = prepare.split_tokens(split)
        rows = prepare.eval_rows(tokenizer, prepare._split_files(split), -(-wanted // MAX_SEQ_LEN))
    except ArtifactRefused as e:
        return None, None, 0, f"the saved model was refused: {e}"
    except (RuntimeError, FileNotFoundError, ValueError, TypeError) as e:  # a split run dry
        return None, None, 0, f"the evaluation of the {split} split failed: {(str(e).splitlines() or ['?'])[0][:300]}"
    return token_bytes, rows, wanted, ""


def evaluate_artifact(path, split="val", ready=None):
    """The controller's measurement: bits per byte of an exported model on a split, computed here from its logits
    (the run's code never runs in this process), after the probes. ready() is called once the data is read and
    checked, before the model or the device is touched (the controller's go: it reads the nonce); None if it
    returns False (called off: no result)."""
    token_bytes, rows, wanted, problem = _evaluation_data(split)
    if ready is not None and not ready():
        return None
    if problem:
        return {"error": problem}
    device = torch.device(os.environ.get("AUTOLOOP_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = "cpu" if device.type == "cpu" else "gpu"
    vocab = len(token_bytes)
    try:
        token_bytes = token_bytes.to(device)
        graph, notes, _ = load_exported(path, device)
        autocast = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}.get(notes.get("autocast"))
    except ArtifactRefused as e:
        return {"error": f"the saved model was refused: {e}"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bound = EVAL_MAX_ELEMENTS_SHARE * EVAL_ROWS * MAX_SEQ_LEN * vocab

    def forward(x):
        with torch.inference_mode(), torch.autocast(device_type=device.type, dtype=autocast or torch.float32,
                                                    enabled=autocast is not None):
            return graph(x, bound)

    t0 = time.time()
    try:
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))  # unguessable
        picks = probe_rows(len(rows), generator)
        nats, nbytes, kept = score(forward, rows, wanted, vocab, token_bytes, device, picks)
        scored = time.time() - t0
        cheat, stats = probe(forward, rows, kept, picks, generator, vocab, device, kind)
    except ArtifactRefused as e:
        return {"error": f"the saved model was refused: {e}"}
    except MemoryError:  # an allocation past the step's memory limit (the controller sets one)
        return {"error": f"the evaluation of the {split} split ran out of memory (the step's memory limit)"}
    except (RuntimeError, FileNotFoundError, ValueError, TypeError) as e:  # a forward that fails
        return {"error": f"the evaluation of the {split} split failed: {(str(e).splitlines() or ['?'])[0][:300]}"}
    if cheat:
        return {"error": f"the saved model was refused: {cheat}", "probe": stats}
    value = nats / (math.log(2) * nbytes)
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        import resource
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    return {"val_bpb" if split == "val" else f"{split}_bpb": value, "split": split, "eval_tokens": wanted,
            "batch_size": EVAL_ROWS, "autocast": notes.get("autocast"), "seconds": round(time.time() - t0, 3),
            "probe_seconds": round(time.time() - t0 - scored, 3), "probes": stats["rows"], "probe": stats,
            "peak_mb": round(peak_mb, 1), "memory_kind": "vram" if device.type == "cuda" else "rss"}


_dumps, _open, _write, _close, _exit = json.dumps, os.open, os.write, os.close, os._exit


def _write_result(path, result):
    """The result file, created anew (a file or link the run left at that name is replaced, never followed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        _write(fd, _dumps(result).encode())
    finally:
        _close(fd)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Score a model exported by prepare.evaluate_bpb (autoloop's "
                                                 "fixed evaluation; the controller runs it after every experiment)")
    parser.add_argument("artifact", help="the exported model (AUTOLOOP_EVAL_ARTIFACT of the run)")
    parser.add_argument("--split", default="val", choices=["val", "holdout"], help="which split to score")
    parser.add_argument("--result", metavar="FILE", help="write the result here, with the nonce read from the "
                                                          "first line of stdin (controller use); else print it")
    args = parser.parse_args()
    # The controller's channel is a file holding its nonce (read from stdin), never parsed from output. The
    # process may start before train.py's has ended (prepare.EXPORT_LINE): the nonce, read only once the data is
    # ready, is its go, and no nonce (stdin closed) means that it was called off.
    told = []

    def ready():
        told.append(sys.stdin.readline().strip() if args.result else "")
        return bool(told[0]) or not args.result

    try:
        result = evaluate_artifact(args.artifact, args.split, ready)
    except Exception as e:  # noqa: BLE001 - whatever the model did, the controller gets a result that says so
        first = (str(e).splitlines() or [""])[0][:200]
        result = {"error": f"the evaluation failed: {type(e).__name__}: {first}"}
    if result is None or (not told and not ready()):  # called off before, or (after a failure) now
        print("evaluate.py: called off by the controller (no nonce); nothing evaluated", flush=True)
        _exit(3)
    if args.result:
        _write_result(args.result, {**result, "nonce": told[0]})
    else:
        print("AUTOLOOP_EVAL " + json.dumps(result), flush=True)
    _exit(3 if "error" in result else 0)
