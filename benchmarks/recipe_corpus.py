"""Run llm-compressor's own recipes, unchanged, through llmc-fsm (issue 22's corpus measurement).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/recipe_corpus.py LLMC_CHECKOUT [--rev HEAD] [--out results.json]
        [--timeout 120] [--only SUBSTRING] [--list]
    OMP_NUM_THREADS=1 python benchmarks/recipe_corpus.py LLMC_CHECKOUT --rerun OLD.json --out NEW.json
        # only the recipes OLD.json did not record as "reload equal" (or "not run"); NEW.json = OLD.json with them
        # replaced (with --refamily: only those whose tiny family is not the one OLD.json recorded)

``LLMC_CHECKOUT`` is a source checkout of llm-compressor: a working tree, or a git directory (bare or a mirror;
its files are read with ``git show REV:path`` at ``--rev``). Nothing of it is copied into this repository: the
recipes are extracted at run time.

What counts as a recipe, as its users write it:

- a YAML file under ``tests/`` or ``examples/`` whose mapping is a recipe (stages, ``<group>_modifiers``,
  modifier names);
- a YAML test config under those folders with an inline ``recipe:`` (a mapping or YAML text), or with a
  ``scheme:`` and no recipe: llm-compressor's test harness (``tests/e2e/e2e_utils.py``, ``build_recipe``) then
  builds ``QuantizationModifier(targets="Linear", scheme=SCHEME, ignore=["lm_head", "re:.*mlp.gate[.].*"])``
  (``GPTQModifier`` with ``actorder=None`` for ``quant_type: GPTQ``), which is what is run. A config whose
  ``recipe:`` names a recipe file only contributes its model stub to that file's entry;
- each ``oneshot(..., recipe=EXPR)`` call of ``examples/**/*.py``: ``EXPR`` (or the last assignment to the name it
  is before the call) is read with :mod:`ast`; YAML text, an ``XModifier(kw=literal, ...)`` call or a list of
  them become the equivalent recipe (a list: one stage in list form, in order). ``QuantizationScheme(...)`` (with
  ``**PRESET`` of a compressed-tensors preset: ``preset: PRESET``) /
  ``QuantizationArgs(...)`` / ``dict(...)`` calls become the mapping of their keyword arguments, and members of
  compressed-tensors' string enums (``QuantizationStrategy.GROUP``) their value (``"group"``). A recipe with any
  other expression is not run; it is counted as "not literal" with the expression named.

Each recipe is run, unchanged, in a forked process with a time limit (``--timeout``):

(a) ``llmc_fsm.session.explain.explain(Session(recipe.yaml))`` (what ``llmc-fsm explain recipe.yaml`` prints);
(b) ``llmc_fsm.oneshot`` on a tiny random model of the architecture its model stub names
    (``tests/tiny_families.py``; tiny Llama where the family is not known or not buildable there, recorded),
    in bfloat16 (the dtype the examples load their checkpoints in), calibrated on 8 windows of 32 tokens from the
    tail of ``wiki.test.raw`` (each byte ``b`` is token ``3 + b % 125``: the tiny models have 128 tokens);
(c) the saved directory reloaded with transformers (``from_pretrained``) and its logits compared with the
    in-memory model's on one window (``torch.equal``, else the largest absolute difference).

``--from-directory``: (b) saves the tiny model with ``save_pretrained`` first and gives ``oneshot`` that directory
(``dtype`` the same), the path a user's checkpoint takes: its config read and every modifier check run on the
``meta``-device model before any weight is read; (c) compares with the model ``oneshot`` returns.

Each ``model_free_ptq(...)`` call of ``examples/**/*.py`` is an entry too (kind ``python model_free_ptq``), its
keyword arguments read as ``recipe=`` values are: run on the tiny model of its family saved as a directory, ``device``
left out (the scripts name ``cuda:0``; this machine's CPU instead), the output reloaded with transformers and its
logits compared with those of ``oneshot``'s output for the same scheme and ignore on the same directory (class
``for vLLM (oneshot refuses the scheme: ...)`` where ``oneshot`` refuses that recipe: a scheme transformers'
fused-experts loader cannot read right, which ``model_free_ptq`` writes per expert with a warning line); a
``converter`` (a checkpoint stored in another format) is not literal.

Fused experts saved with a scheme that transformers does not reload into them but vLLM reads per expert (NVFP4,
FP8 block: ``llmc_fsm.toolkit.experts_for_vllm``) are checked instead of reloaded: every saved expert matrix
decompressed with compressed-tensors' compressor must equal the in-memory one (class ``for vLLM (every saved expert
decompresses to the in-memory one ...)``); a ``model_free_ptq`` entry's output must then also equal ``oneshot``'s
tensor for tensor (``for vLLM (equal to oneshot's output ...)``).

Classes: ``reload equal`` / ``reload differs`` (ran, but the reloaded logits differ, or the reload failed) /
``refused`` (an llmc-fsm error raised by llmc-fsm's own code: ``ValueError`` and its subclasses such as
``RecipeError``, ``ModifierError``, ``MissingStateError``, ``NotImplementedError``; grouped by the first line of the
message with names and numbers kept) / ``crashed`` (any other exception, or one raised outside llmc-fsm: a bug) /
``timeout``. For each run, every argument the recipe gives that the saved ``recipe.yaml`` records with another
value, or not at all, is listed (``recipe_diff``) to spot a field that was silently ignored. The results go to
``--out`` (JSON) and a markdown summary to stdout.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
WIKI = Path("/work/shared/data/wikitext-2-raw/wiki.test.raw")
NUM_WINDOWS, WINDOW = 8, 32

# ----------------------------------------------------------------------------------------------- reading the checkout


class Checkout:
    """The files of an llm-compressor checkout: a working tree, or a git directory at a revision."""

    def __init__(self, path: Path, rev: str) -> None:
        self.path, self.rev = path, rev
        self.git = not (path / "examples").is_dir() and (path / "HEAD").exists()

    def files(self) -> list[str]:
        if self.git:
            out = subprocess.run(
                ["git", "-C", str(self.path), "ls-tree", "-r", "--name-only", self.rev],
                capture_output=True, text=True, check=True,
            ).stdout
            return out.splitlines()
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())

    def read(self, name: str) -> str:
        if self.git:
            return subprocess.run(
                ["git", "-C", str(self.path), "show", f"{self.rev}:{name}"], capture_output=True, text=True, check=True
            ).stdout
        return (self.path / name).read_text(encoding="utf-8")

    def revision(self) -> str:
        git_dir = ["-C", str(self.path)]
        done = subprocess.run(["git", *git_dir, "rev-parse", self.rev], capture_output=True, text=True, check=False)
        return done.stdout.strip() or "(not a git checkout)"


@dataclass
class Entry:
    """One recipe of the corpus."""

    source: str  # path in the checkout, with ":LINE" for a oneshot call in a Python example
    kind: str  # "yaml recipe" | "config recipe" | "config scheme" | "python example"
    recipe: Any = None  # YAML text or a mapping; None: not runnable (see note)
    modifiers: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # model stubs the file (or configs naming it) give
    note: str = ""  # why it is not runnable


# --------------------------------------------------------------------------------------------------- YAML sources

_GROUP_KEYS = re.compile(r"(_modifiers|Modifier|^modifiers|^stages)$")


def _recipe_like(d: Any) -> bool:
    """A mapping shaped like a recipe: a modifier group / modifier / stages key at the top or one level down."""
    if not isinstance(d, dict):
        return False
    for k, v in d.items():
        if isinstance(k, str) and _GROUP_KEYS.search(k):
            return True
        if isinstance(v, dict) and any(isinstance(k2, str) and _GROUP_KEYS.search(k2) for k2 in v):
            return True
        if isinstance(v, list) and v and all(isinstance(m, (dict, str)) for m in v) and any(
            isinstance(m, dict) and any(str(k2).endswith("Modifier") for k2 in m) for m in v
        ):
            return True
    return False


def modifier_names(recipe: Any) -> list[str]:
    """Every ``...Modifier`` key (or bare list item) of a recipe mapping, in order."""
    if isinstance(recipe, str):
        try:
            recipe = yaml.safe_load(recipe)
        except yaml.YAMLError:
            return []
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and k.endswith("Modifier"):
                    found.append(k)
                else:
                    walk(v)
        elif isinstance(node, list):
            for item in node:
                if isinstance(item, str) and item.endswith("Modifier"):
                    found.append(item)
                else:
                    walk(item)

    walk(recipe)
    return found


def _harness_recipe(scheme: Any, quant_type: Any) -> dict[str, Any]:
    """llm-compressor's ``tests/e2e/e2e_utils.py::build_recipe`` for a config with a scheme and no recipe."""
    ignore = ["lm_head", "re:.*mlp.gate[.].*"]
    if quant_type == "GPTQ":
        gptq = {"targets": "Linear", "scheme": scheme, "actorder": None, "ignore": ignore}
        return {"default": [{"GPTQModifier": gptq}]}
    return {"default": [{"QuantizationModifier": {"targets": "Linear", "scheme": scheme, "ignore": ignore}}]}


def yaml_entries(checkout: Checkout, names: list[str]) -> tuple[list[Entry], list[Entry]]:
    """Recipe entries from the YAML files, and the YAML files that hold no recipe (with why)."""
    recipes: dict[str, Entry] = {}
    configs: list[Entry] = []
    other: list[Entry] = []
    referenced: dict[str, list[str]] = defaultdict(list)
    for name in names:
        text = checkout.read(name)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            other.append(Entry(name, "yaml", note=f"not YAML: {str(err).splitlines()[0]}"))
            continue
        if _recipe_like(data):
            recipes[name] = Entry(name, "yaml recipe", text, modifier_names(data))
            continue
        if not isinstance(data, dict):
            other.append(Entry(name, "yaml", note="not a mapping"))
            continue
        model = data.get("model") or data.get("model_stub") or data.get("compressed_model_stub")
        models = [str(model)] if model else []
        recipe = data.get("recipe") or data.get("new_recipe")
        if isinstance(recipe, dict):
            configs.append(Entry(name, "config recipe", recipe, modifier_names(recipe), models))
        elif isinstance(recipe, str) and re.search(r"\.ya?ml$", recipe.strip()):
            referenced[recipe.strip()].extend(models or ["(config without model)"])
            other.append(Entry(name, "config", note=f"names a recipe file ({recipe.strip()})", models=models))
        elif isinstance(recipe, str) and "\n" in recipe and _recipe_like(yaml.safe_load(recipe)):
            configs.append(Entry(name, "config recipe", recipe, modifier_names(recipe), models))
        elif isinstance(recipe, str):
            entry = data.get("entrypoint", "?")
            other.append(Entry(name, "config", note=f"recipe is a name ({recipe}), entrypoint {entry}", models=models))
        elif data.get("scheme") is not None:
            built = _harness_recipe(data["scheme"], data.get("quant_type"))
            configs.append(Entry(name, "config scheme", built, modifier_names(built), models))
        else:
            other.append(Entry(name, "config", note="no recipe and no scheme", models=models))
    for path, models in referenced.items():
        if path in recipes:
            recipes[path].models.extend(m for m in models if m not in recipes[path].models)
        else:  # e.g. a path the checkout no longer has
            other.append(Entry(path, "config", note="recipe file named by a config, not in the checkout"))
    return list(recipes.values()) + configs, other


# ------------------------------------------------------------------------------------------------- Python examples


class NotLiteral(Exception):
    """An expression of a recipe that is not a literal (its source in ``args[0]``)."""


_ENUMS = ("QuantizationStrategy", "QuantizationType", "ActivationOrdering", "DynamicType")
_MAPPING_CALLS = ("QuantizationScheme", "QuantizationArgs", "dict")
_MODEL_NAMES = re.compile(r"^(MODEL_ID|MODEL_STUB|MODEL_NAME|MODEL|model_id|model_stub|model_name|MODEL_PATH)$")


class _Literals:
    """Literal evaluation of an example's expressions; a name is the last assignment to it before a line."""

    def __init__(self, tree: ast.Module) -> None:
        self.assigned: dict[str, list[tuple[int, ast.expr]]] = defaultdict(list)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.assigned[target.id].append((node.lineno, node.value))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self.assigned[node.target.id].append((node.lineno, node.value))
            elif isinstance(node, (ast.AugAssign,)) and isinstance(node.target, ast.Name):
                self.assigned[node.target.id].append((node.lineno, node))  # += makes it non-literal
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                f = node.value.func  # recipe.append(...) / recipe.extend(...) make it non-literal
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr in ("append", "extend"):
                    self.assigned[f.value.id].append((node.lineno, node))

    def name(self, name: str, line: int) -> ast.AST:
        before = [(ln, v) for ln, v in self.assigned.get(name, []) if ln < line]
        if not before:
            raise NotLiteral(f"{name} (not assigned before line {line})")
        return before[-1][1]

    def value(self, node: ast.AST, line: int) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e, line) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise NotLiteral(ast.unparse(node))
            return {self.value(k, line): self.value(v, line) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -node.operand.value
        if isinstance(node, ast.Name):
            target = self.name(node.id, line)
            if not isinstance(target, ast.expr):
                raise NotLiteral(f"{node.id} (changed by line {target.lineno}: {ast.unparse(target).splitlines()[0]})")
            return self.value(target, line)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in _ENUMS:
            return node.attr.lower()
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func and (func.endswith("Modifier") or func in _MAPPING_CALLS):
                preset = self._preset_spread(func, node, line)
                spread = [kw for kw in node.keywords if kw.arg is None]
                if node.args or (spread and preset is None):
                    raise NotLiteral(ast.unparse(node).splitlines()[0][:120] + " (positional or ** arguments)")
                kwargs = {kw.arg: self.value(kw.value, line) for kw in node.keywords if kw.arg is not None}
                if preset is not None:  # QuantizationScheme(targets=[...], **FP8_BLOCK): the preset, by name
                    kwargs["preset"] = preset
                return {func: kwargs} if func.endswith("Modifier") else kwargs
        raise NotLiteral(ast.unparse(node).splitlines()[0][:120])

    def _preset_spread(self, func: str, node: ast.Call, line: int) -> str | None:
        """``NAME`` of a ``QuantizationScheme(..., **NAME)`` call whose one ``**`` argument is a compressed-tensors
        preset imported as is (not assigned in the example), else ``None``."""
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        spread = [kw for kw in node.keywords if kw.arg is None]
        if func != "QuantizationScheme" or len(spread) != 1 or not isinstance(spread[0].value, ast.Name):
            return None
        name = spread[0].value.id
        if name not in PRESET_SCHEMES or any(ln < line for ln, _ in self.assigned.get(name, [])):
            return None
        return name

    def model_stub(self) -> str | None:
        for name, values in self.assigned.items():
            if _MODEL_NAMES.match(name):
                for _, v in values:
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        return v.value
        return None


def _as_recipe(value: Any) -> tuple[Any, str]:
    """The recipe a literal ``recipe=`` value means, and a note when it is not one."""
    if isinstance(value, str):
        try:
            data = yaml.safe_load(value)
        except yaml.YAMLError:
            data = None
        if _recipe_like(data):
            return value, ""
        return None, f"recipe is a string that is not a recipe: {value[:60]!r}"
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)).endswith("Modifier"):
        value = [value]
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and len(m) == 1 and next(iter(m)).endswith("Modifier") for m in value
    ):
        return {"default": value}, ""
    return None, f"recipe value is not modifiers: {str(value)[:80]}"


def python_entries(checkout: Checkout, names: list[str]) -> tuple[list[Entry], list[Entry]]:
    """Recipe entries from the ``oneshot(recipe=...)`` calls of the Python examples, and the files without one."""
    entries: list[Entry] = []
    other: list[Entry] = []
    for name in names:
        try:
            tree = ast.parse(checkout.read(name))
        except SyntaxError as err:
            other.append(Entry(name, "python", note=f"does not parse: {err}"))
            continue
        literals = _Literals(tree)
        stub = literals.model_stub()
        calls = []
        entrypoints = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if func == "oneshot":
                    calls.append(node)
                elif func == "model_free_ptq":
                    entries.append(_model_free_entry(name, node, literals, stub))
                    entrypoints.add(func)
                elif func in ("train", "reap", "convert_checkpoint"):
                    entrypoints.add(func)
        if "model_free_ptq" in entrypoints and not calls:
            continue
        if not calls:
            why = f"no oneshot call (calls {', '.join(sorted(entrypoints))})" if entrypoints else "no oneshot call"
            other.append(Entry(name, "python", note=why, models=[stub] if stub else []))
            continue
        for call in sorted(calls, key=lambda c: c.lineno):
            source = f"{name}:{call.lineno}"
            models = [stub] if stub else []
            kw = {k.arg: k.value for k in call.keywords}
            if "recipe" not in kw:
                note = "oneshot(**...) (recipe not literal)" if None in kw else "oneshot without recipe="
                entries.append(Entry(source, "python example", models=models, note=f"not literal: {note}"))
                continue
            try:
                value = literals.value(kw["recipe"], call.lineno)
            except NotLiteral as err:
                entries.append(Entry(source, "python example", models=models, note=f"not literal: {err.args[0]}"))
                continue
            recipe, note = _as_recipe(value)
            entries.append(Entry(source, "python example", recipe, modifier_names(recipe), models, note))
    return entries, other


#: ``model_free_ptq`` arguments of llm-compressor's scripts that the harness does not pass on: where the model is
#: read and written (the tiny model's directory and a temporary output instead), and the device (this machine's
#: CPU: the scripts name ``cuda:0``; the output is the same on either).
_MODEL_FREE_PLACES = ("model_stub", "save_directory", "device")


def _model_free_entry(name: str, call: ast.Call, literals: _Literals, stub: str | None) -> Entry:
    """A ``model_free_ptq(...)`` call of a Python example as an entry: its literal keyword arguments (kind
    ``python model_free_ptq``, ``recipe`` = ``{"model_free_ptq": {argument: value}}``)."""
    source = f"{name}:{call.lineno}"
    models = [stub] if stub else []
    args: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            return Entry(source, "python model_free_ptq", models=models, note="not literal: model_free_ptq(**...)")
        if keyword.arg in _MODEL_FREE_PLACES:
            continue
        try:
            args[keyword.arg] = literals.value(keyword.value, call.lineno)
        except NotLiteral as err:
            why = err.args[0]
            if keyword.arg == "converter":
                why = f"converter: reads a checkpoint stored in another format ({why})"
            return Entry(source, "python model_free_ptq", models=models, note=f"not literal: {why}")
    scheme = args.get("scheme")
    modifiers = ["model_free_ptq"] + ([str(scheme)] if isinstance(scheme, str) else [])
    return Entry(source, "python model_free_ptq", {"model_free_ptq": args}, modifiers, models)


def corpus(checkout: Checkout) -> tuple[list[Entry], list[Entry]]:
    """Every recipe entry of the checkout, and the examined files that hold none."""
    names = [n for n in checkout.files() if n.startswith(("tests/", "examples/"))]
    ymls = [n for n in names if n.endswith((".yaml", ".yml"))]
    pys = [n for n in names if n.startswith("examples/") and n.endswith(".py")]
    y_entries, y_other = yaml_entries(checkout, ymls)
    p_entries, p_other = python_entries(checkout, pys)
    return y_entries + p_entries, y_other + p_other


# --------------------------------------------------------------------------------------------------- model family

#: (pattern in the lower-cased model stub, tiny family) in order; first match wins.
_FAMILY_PATTERNS = [
    (r"llama-?4", "llama4"),  # Llama-4 Scout / Maverick: the vision-language class its examples load
    (r"llama-3\.2-\d+b-vision|mllama", "mllama"),
    (r"llava", "llava"),
    (r"pixtral", "llava_pixtral"),
    (r"mistral-small-3|mistral3|devstral", "mistral3"),
    (r"idefics3|smolvlm", "idefics3"),
    (r"qwen2-audio", "qwen2_audio"),
    (r"whisper", "whisper"),
    (r"qwen2-vl", "qwen2_vl"),
    (r"qwen3-next", "qwen3_next"),
    (r"qwen3\.[56]-[\d.]+b-a[\d.]+b", "qwen3_5_moe_vlm"),  # Qwen3.5 / 3.6 MoE: their examples load the VLM class
    (r"qwen3\.[5-9]-[\d.]+b-a[\d.]+b", "qwen3_5_moe"),  # Qwen3.8-1.0B-A0.6B: its examples load AutoModelForCausalLM
    (r"qwen3\.[5-9]-[\d.]+b", "qwen3_5_vlm"),  # Qwen3.5-27B, Qwen3.8-27B: Qwen3_5ForConditionalGeneration
    (r"qwen3-\d+b-a\d+b|qwen3-coder-30b|qwen3_moe|qwen1\.5-moe", "qwen3_moe"),
    (r"mixtral", "mixtral"),
    (r"deepseek-v4", "deepseek_v4"),
    (r"deepseek-v3|deepseek-r1|moonlight|kimi-k2", "deepseek_v3"),
    (r"glm-5(?!\.[3-9])", "glm5"),  # GLM-5, 5.1, 5.2: glm_moe_dsa (GLM-5.3-Flash is glm5_next, a VLM)
    (r"gpt-oss", "gpt_oss"),
    (r"gemma-2", "gemma2"),
    (r"gemma-3-\d+b-it|medgemma", "gemma3_vlm"),
    (r"gemma-3", "gemma3"),
    (r"falcon-h1", "falcon_h1"),
    (r"nemotron-h|nemotron-3", "nemotron_h"),
    (r"jamba", "jamba"),
    (r"dbrx", "dbrx"),
    (r"command-a|command-r7b", "cohere2"),
    (r"command-r", "cohere"),  # Command R (v01, plus): parallel attention and MLP, no sliding window
    (r"c4ai|cohere", "cohere2"),
    (r"phi-?3", "phi3"),
    (r"qwen3", "qwen3"),
    (r"qwen2|qwq", "qwen2"),
    (r"exaone-4", "exaone4"),
    (r"olmo-3", "olmo3"),
    (r"gpt2", "gpt2"),
    (r"llama|tinyllama|smollm|mistral-7b", "llama"),
]


def family_of(models: list[str]) -> tuple[str, str]:
    """The tiny family to run for these model stubs, and how it was chosen."""
    from tiny_families import FAMILIES

    for stub in models:
        for pattern, family in _FAMILY_PATTERNS:
            if re.search(pattern, stub.lower()):
                if family is None or family not in FAMILIES:
                    return "llama", f"{stub}: no tiny model of its family, tiny Llama"
                return family, stub
    if models:
        return "llama", f"{models[0]}: family not known here, tiny Llama"
    return "llama", "no model stub, tiny Llama"


# ----------------------------------------------------------------------------------------------------------- run


#: Widths of the tiny models, widened so that llm-compressor's group size 128 and 128 x 128 FP8 blocks divide every
#: Linear's input (and output) width, as they do on the real checkpoints; applied where the config has the field.
_WIDE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "head_dim": 64,
    "moe_intermediate_size": 128,  # not hidden_size: llmc-fsm refuses square fused experts
    "shared_expert_intermediate_size": 256,
    "moe_shared_expert_intermediate_size": 256,  # Nemotron-H's shared expert (transformers' default 7688)
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "mamba_d_head": 64,
    "mamba_head_dim": 64,
    "mamba_d_ssm": 512,
    "index_head_dim": 128,  # DSA / Lightning indexer heads (GLM-5, DeepSeek-V4): wider than their rotary part
    "o_lora_rank": 64,  # DeepSeek-V4's grouped output projection: o_b_proj reads o_groups x o_lora_rank
}


def tiny_model(family: str, dtype: Any) -> tuple[Any, str]:
    """The tiny random model of ``family`` (tests/tiny_families.py) built in ``dtype`` (so that fp32 buffers such as
    the rotary ``inv_freq`` stay fp32, as ``from_pretrained`` leaves them), widened (:data:`_WIDE`) where it builds
    and runs so; else the narrow one (recorded)."""
    import torch
    import transformers
    from tiny_families import FAMILIES, config

    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")

    def make(cfg: Any, check: bool) -> Any:
        torch.manual_seed(0)
        model = cls.from_config(cfg, dtype=dtype) if hasattr(cls, "from_config") else cls(cfg).to(dtype)
        model.eval()
        for module in model.modules():  # DeepSeek-V4's hash routers: transformers inits tid2eid to zeros (every token
            table = getattr(module, "tid2eid", None)  # to expert 0); a checkpoint has a hash of token ids
            if isinstance(table, torch.Tensor):
                gen = torch.Generator().manual_seed(0)
                table.copy_(torch.stack([torch.randperm(module.num_experts, generator=gen)[: table.shape[1]]
                                         for _ in range(table.shape[0])]))
        if check:  # the widened fields fit together
            with torch.no_grad():
                model(input_ids=torch.randint(3, 128, (1, 8)))
        return model

    cfg = config(family)
    for part in (cfg, getattr(cfg, "text_config", None)):
        if part is None:
            continue
        for key, value in _WIDE.items():
            if getattr(part, key, None) is not None:
                setattr(part, key, value)
        if getattr(part, "qk_head_dim", None) is not None:  # derived in the config's __init__ (DeepSeek's MLA)
            part.qk_head_dim = part.qk_nope_head_dim + part.qk_rope_head_dim
            part.v_head_dim = part.qk_head_dim  # (torch 2.13's CPU attention fails on this one with a narrower v)
        elif getattr(part, "partial_rotary_factor", None) and getattr(part, "qk_rope_head_dim", None) is not None:
            part.qk_rope_head_dim = int(part.head_dim * part.partial_rotary_factor)  # derived (DeepSeek-V4)
        rope = getattr(part, "rope_parameters", None) or {}
        if rope.get("mrope_section"):  # Qwen2-VL's sections of the rotary half, scaled to the wider head
            section, half = rope["mrope_section"], part.head_dim // 2
            rope["mrope_section"] = [half * v // sum(section) for v in section[:-1]]
            rope["mrope_section"].append(half - sum(rope["mrope_section"]))
    audio = getattr(cfg, "audio_config", None)
    if audio is not None and getattr(audio, "d_model", None) is not None:  # an audio tower's Linears, as the text's
        audio.d_model, audio.encoder_ffn_dim = _WIDE["hidden_size"], _WIDE["intermediate_size"]
    try:
        return make(cfg, True), ""
    except Exception as exc:
        return make(config(family), False), f"; narrow (width 64): widening failed ({type(exc).__name__})"


def calibration() -> Any:
    """``[NUM_WINDOWS, WINDOW]`` token ids from the tail of wiki.test.raw, one byte a token (3 + byte % 125)."""
    import torch

    raw = WIKI.read_bytes()[-NUM_WINDOWS * WINDOW :]
    ids = torch.tensor([3 + b % 125 for b in raw], dtype=torch.long)
    return ids.reshape(NUM_WINDOWS, WINDOW)


def _is_ours(tb: traceback.StackSummary | list) -> bool:
    """The innermost frame is in llmc-fsm or one of its plugins."""
    if not tb:
        return False
    path = tb[-1].filename
    return str(ROOT) in path or "llmc_fsm" in path


def _failure(step: str, exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    message = (str(exc).strip().splitlines() or [""])[0]
    refusal = isinstance(exc, (ValueError, NotImplementedError)) or type(exc).__name__ in (
        "ModifierError", "MissingStateError", "PluginError",
    )
    cause = exc.__cause__
    if type(exc).__name__ == "ModifierError" and cause is not None and not isinstance(
        cause, (ValueError, NotImplementedError)
    ):  # a modifier hook's own bug (AttributeError, ...) wrapped: a crash, not a refusal
        refusal = False
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    ours = [f for f in frames if str(ROOT) in f.filename]
    return {
        "step": step,
        "exception": type(exc).__name__,
        "message": message,
        "refused": bool(refusal and _is_ours(frames)),
        "raised_at": where,
        "last_llmc_fsm_frame": f"{ours[-1].filename}:{ours[-1].lineno}" if ours else None,
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
    }


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _modifier_args(recipe: Any) -> list[tuple[str, dict[str, Any]]]:
    """(modifier name, arguments) of a recipe mapping, in order."""
    found: list[tuple[str, dict[str, Any]]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and k.endswith("Modifier"):
                    found.append((k, v if isinstance(v, dict) else {}))
                else:
                    walk(v)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(recipe)
    return found


def _same(asked: Any, saved: Any) -> bool:
    """The saved value spells the asked one: case of a string, or a string saved as a one-item list."""
    if isinstance(asked, str) and isinstance(saved, list) and len(saved) == 1:
        saved = saved[0]
    return isinstance(asked, str) and str(saved).lower() == asked.lower()


#: llm-compressor argument names the saved recipe.yaml records under llmc-fsm's name (docs/recipes.md, "renamed").
SAVED_AS = {"weight_observer": "observer"}


def recipe_diff(asked: Any, saved_text: str) -> list[str]:
    """Each argument the recipe gives that the saved recipe.yaml records with another value or not at all."""
    if isinstance(asked, str):
        asked = yaml.safe_load(asked)
    saved = _modifier_args(yaml.safe_load(saved_text) or {})
    out: list[str] = []
    pool = list(saved)
    for name, args in _modifier_args(asked):
        match = next((s for s in pool if s[0] == name), None)
        if match is None:
            out.append(f"{name}: not in the saved recipe")
            continue
        pool.remove(match)
        got = _flatten(match[1])
        for key, value in _flatten(args).items():
            if key not in got and key in SAVED_AS and SAVED_AS[key] in got:  # a documented renaming (docs/recipes.md)
                key = SAVED_AS[key]
            if key not in got:
                out.append(f"{name}.{key}={value!r}: not recorded")
            elif got[key] != value and not _same(value, got[key]):
                out.append(f"{name}.{key}={value!r}: saved {got[key]!r}")
    return out


#: ``--from-directory``: oneshot is given the tiny model saved as a directory (set by :func:`main`).
FROM_DIRECTORY = False


def run_entry(entry: Entry, workdir: Path) -> dict[str, Any]:
    """(a) explain, (b) oneshot on a tiny model, (c) reload and compare logits; in this (forked) process."""
    import logging

    import torch
    import transformers
    from tiny_families import FAMILIES

    from llmc_fsm import Session, oneshot
    from llmc_fsm.session.explain import explain

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if entry.kind == "python model_free_ptq":
        return run_model_free(entry, workdir)
    result: dict[str, Any] = {}
    path = workdir / "recipe.yaml"
    path.write_text(entry.recipe if isinstance(entry.recipe, str) else yaml.safe_dump(entry.recipe, sort_keys=False))
    try:
        explain(Session(str(path)))
        result["explain"] = "ok"
    except Exception as exc:
        result["explain"] = _failure("explain", exc)
    family, why = family_of(entry.models)
    result["family"], result["family_note"] = family, why
    dtype = getattr(torch, os.environ.get("RECIPE_CORPUS_DTYPE", "bfloat16"))
    model, widened = tiny_model(family, dtype)
    result["family_note"] += widened
    data = calibration()
    out = workdir / "out"
    given: Any = model
    if FROM_DIRECTORY:
        given = workdir / "model"
        model.save_pretrained(given)
    try:
        returned = oneshot(
            model=given if given is model else str(given), recipe=str(path), dataset=data,
            num_calibration_samples=NUM_WINDOWS, max_seq_length=WINDOW, output_dir=str(out), progress=False, threads=1,
            device="cpu", batch_size=4, **({} if given is model else {"dtype": str(dtype).removeprefix("torch.")}),
        )
        model = returned if given is not model else model
    except Exception as exc:
        result["oneshot"] = _failure("oneshot", exc)
        return result
    result["oneshot"] = "ok"
    saved = out / "recipe.yaml"
    result["saved_recipe"] = saved.read_text() if saved.exists() else None
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    result["quantization_config"] = config.get("quantization_config")
    result["recipe_diff"] = recipe_diff(entry.recipe, result["saved_recipe"]) if result["saved_recipe"] else []
    window = _model_inputs(model, data[:1])
    try:  # the model oneshot returned must still run (a failure here is llmc-fsm's: classed crashed)
        with torch.no_grad():
            ref = model(**window).logits.float()
    except Exception as exc:
        result["oneshot"] = _failure("the returned model's forward", exc)
        result["oneshot"]["refused"] = False
        return result
    experts = _experts_for_vllm(model, out, result["quantization_config"])
    if experts is not None:
        result["experts_for_vllm_equal"] = experts
    try:
        cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
        reloaded = cls.from_pretrained(str(out), dtype=dtype).eval()
        with torch.no_grad():
            got = reloaded(**window).logits.float()
        result["reload_max_abs_logit_diff"] = float((got - ref).abs().max())
        result["reload_equal"] = bool(torch.equal(got, ref))
        if not result["reload_equal"] and (result["quantization_config"] or {}).get("kv_cache_scheme"):
            # KV-cache or attention quantization: transformers 5.24 ignores the saved q/k/v scales
            from llmc_fsm_quantization import load_kv_cache_scales

            load_kv_cache_scales(reloaded, out)
            with torch.no_grad():
                got = reloaded(**window).logits.float()
            result["reload_equal_with_kv_scales"] = bool(torch.equal(got, ref))
    except Exception as exc:
        result["reload"] = _failure("reload", exc)
    return result


def _experts_for_vllm(model: Any, out: Path, config: dict[str, Any] | None) -> bool | None:
    """Where ``model``'s fused experts were saved with a scheme transformers does not reload into them but vLLM
    reads per expert (``llmc_fsm.toolkit.experts_for_vllm``: NVFP4, FP8 block), whether every saved expert matrix
    decompresses (compressed-tensors' compressor of its config group's format) to the in-memory one exactly;
    ``None`` where there is no such expert."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file

    from llmc_fsm.toolkit import expert_checkpoint_names, expert_reload_problem, experts_for_vllm, weight_views

    groups = (config or {}).get("config_groups") or {}
    saved: dict[str, Any] | None = None
    equal: bool | None = None
    for name, module in model.named_modules():
        views = weight_views(module)
        if not views or next(iter(views.values())).expert is None:
            continue
        try:
            names = expert_checkpoint_names(model, name, module)
        except ValueError:  # transformers reloads them as Linear modules (Llama 4): the reload compares them
            continue
        for suffix, view in views.items():
            ckpt = names[suffix]
            matched = (g for g in groups.values() if any(t == "Linear" or match_name(ckpt, t) for t in g["targets"]))
            group = next(matched, None)
            if group is None:
                continue
            scheme = QuantizationScheme.model_validate(group)
            if not experts_for_vllm(scheme) or expert_reload_problem(scheme) is None:
                continue
            if saved is None:
                saved = {k: v for file in sorted(out.glob("*.safetensors")) for k, v in load_file(file).items()}
            tensors = {k.removeprefix(ckpt + "."): v for k, v in saved.items() if k.startswith(ckpt + ".")}
            weight = BaseCompressor.get_value_from_registry(group["format"]).decompress(tensors, scheme)["weight"]
            same = bool(torch.equal(weight.to(view.weight.dtype), view.weight))
            equal = same if equal is None else equal and same
    return equal


def run_model_free(entry: Entry, workdir: Path) -> dict[str, Any]:
    """A ``model_free_ptq`` call: (b) on the tiny model of its family saved as a directory (bfloat16), its arguments
    as written (``device`` left out: the CPU); (c) the output reloaded with transformers, its logits compared with
    those of ``oneshot``'s output for the same scheme and ignore (a one-stage ``QuantizationModifier`` recipe) on the
    same directory, reloaded too; where ``oneshot`` refuses the recipe, whether the output reloads at all."""
    import torch
    import transformers
    from tiny_families import FAMILIES

    from llmc_fsm import model_free_ptq, oneshot

    args = dict(entry.recipe["model_free_ptq"])
    result: dict[str, Any] = {"explain": "not applicable (no recipe)"}
    family, why = family_of(entry.models)
    result["family"], result["family_note"] = family, why
    dtype = getattr(torch, os.environ.get("RECIPE_CORPUS_DTYPE", "bfloat16"))
    model, widened = tiny_model(family, dtype)
    result["family_note"] += widened
    source = workdir / "model"
    model.save_pretrained(source)
    try:
        model_free_ptq(source, workdir / "out", progress=False, **args)
    except Exception as exc:
        result["oneshot"] = _failure("model_free_ptq", exc)
        return result
    result["oneshot"] = "ok"
    config = json.loads((workdir / "out" / "config.json").read_text())
    result["quantization_config"] = config.get("quantization_config")
    result["model_free_recipe"] = (workdir / "out" / "recipe.yaml").read_text()
    window = _model_inputs(model, calibration()[:1])
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    scheme = args.get("scheme")
    group = {"targets": ["Linear"], "scheme": scheme} if isinstance(scheme, str) else {"config_groups": {"g": scheme}}
    if args.get("config") is not None:
        group = {"config_groups": args["config"].get("config_groups")}
    ignore = [*((args.get("config") or {}).get("ignore") or []), *(args.get("ignore") or [])]
    recipe = {"stage": {"QuantizationModifier": {**group, **({"ignore": ignore} if "ignore" in args else {})}}}
    try:
        returned = oneshot(model=str(source), recipe=recipe, output_dir=str(workdir / "ref"), progress=False,
                           threads=1, device="cpu", dtype=str(dtype).removeprefix("torch."))  # fmt: skip
        ref_config = json.loads((workdir / "ref" / "config.json").read_text()).get("quantization_config")
        experts = _experts_for_vllm(returned, workdir / "ref", ref_config)
        if experts is not None:  # oneshot's experts are for vLLM too: the two outputs compared tensor for tensor
            from safetensors.torch import load_file
            ours = {k: v for f in sorted((workdir / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
            theirs = {k: v for f in sorted((workdir / "ref").glob("*.safetensors")) for k, v in load_file(f).items()}
            result["model_free_equal_oneshot"] = experts and sorted(ours) == sorted(theirs) and all(
                torch.equal(ours[k], theirs[k]) for k in ours
            )
        with torch.no_grad():
            ref = cls.from_pretrained(str(workdir / "ref"), dtype=dtype).eval()(**window).logits.float()
    except Exception as exc:
        result["reference"] = _failure("oneshot reference", exc)
        ref = None
    try:
        with torch.no_grad():
            got = cls.from_pretrained(str(workdir / "out"), dtype=dtype).eval()(**window).logits.float()
    except Exception as exc:
        result["reload"] = _failure("reload", exc)
        return result
    if ref is not None:
        result["reload_max_abs_logit_diff"] = float((got - ref).abs().max())
        result["reload_equal"] = bool(torch.equal(got, ref))
    return result


def _model_inputs(model: Any, window: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits' inputs: the token ids; an encoder-decoder model (Whisper) reads them as its decoder's and random
    audio features (seed 0) as its encoder's."""
    import torch

    config = model.config
    if not getattr(config, "is_encoder_decoder", False):
        return {"input_ids": window}
    gen = torch.Generator().manual_seed(0)
    shape = (window.shape[0], config.num_mel_bins, 2 * config.max_source_positions)
    features = torch.randn(shape, generator=gen).to(next(model.parameters()).dtype)
    return {"input_features": features, "decoder_input_ids": window}


def _child(entry: Entry, workdir: str, queue: Any) -> None:
    try:
        queue.put(run_entry(entry, Path(workdir)))
    except BaseException as exc:
        queue.put({"harness_error": _failure("harness", exc)})


def run_forked(entry: Entry, timeout: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="recipe-corpus-") as workdir:
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(entry, workdir, queue))
        t0 = time.monotonic()
        proc.start()
        result: dict[str, Any] | None = None
        while time.monotonic() - t0 < timeout:
            try:
                result = queue.get(timeout=1.0)
                break
            except Exception:
                if not proc.is_alive() and queue.empty():
                    break
        if result is None:
            if proc.is_alive():
                proc.kill()
                result = {"timeout": timeout}
            else:
                died = {"exception": f"child exited {proc.exitcode}", "message": "", "refused": False}
                result = {"harness_error": died}
        proc.join(5)
        result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def classify(result: dict[str, Any]) -> str:
    if "timeout" in result:
        return "timeout"
    if "harness_error" in result:
        return "harness error"
    one = result.get("oneshot")
    if isinstance(one, dict):
        return "refused" if one["refused"] else "crashed"
    # before "reload equal": transformers reloads these experts wrong (equally wrong for two outputs)
    if result.get("experts_for_vllm_equal"):
        return "for vLLM (every saved expert decompresses to the in-memory one; transformers does not reload them)"
    if result.get("model_free_equal_oneshot"):
        return (
            "for vLLM (equal to oneshot's output tensor for tensor, its experts checked; transformers does not "
            "reload them)"
        )
    if result.get("reload_equal"):
        return "reload equal"
    if isinstance(result.get("reference"), dict):
        return "for vLLM (oneshot refuses the scheme: transformers does not reload it right)"
    return "reload differs"


# ---------------------------------------------------------------------------------------------------------- report


def _reason(text: str) -> str:
    """A refusal's message as a group key: the temporary path dropped, numbers as N, the module list cut."""
    text = re.sub(r"recipe \S*recipe-corpus-\w+/recipe\.yaml, ", "", text)
    text = re.sub(r"line \d+, ", "", text)
    text = re.sub(r"\d+", "N", text)
    return text[:150]


def _write(path: Path, ours: str, rows: list[dict[str, Any]], other: list[Entry]) -> None:
    """The results file: llmc-fsm's revision (:func:`our_revision`), the rows, the files that hold no recipe."""
    path.write_text(json.dumps({"llmc_fsm": ours, "rows": rows, "other": [asdict(e) for e in other]}, indent=1,
                               default=str))


def our_revision() -> str:
    """The llmc-fsm revision the rows are taken at: ``git rev-parse HEAD`` of this checkout, ``+dirty`` when its
    tracked files differ from it (a run spanning edits says so), or ``unknown`` outside a git checkout."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"], check=False).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def markdown(rows: list[dict[str, Any]], other: list[Entry], revision: str) -> str:
    for r in rows:
        if r["class"] != "not run":
            r["class"] = classify(r["result"])
        if r["result"].get("saved_recipe"):
            r["result"]["recipe_diff"] = recipe_diff(r["recipe"], r["result"]["saved_recipe"])
    lines = [f"llm-compressor revision {revision}; {len(rows)} recipes ({len(other)} examined files hold none).", ""]
    counts = Counter(r["class"] for r in rows)
    lines += ["| class | recipes |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in counts.most_common()]
    kinds = Counter((r["kind"], r["class"]) for r in rows)
    lines += ["", "| source kind | class | recipes |", "|---|---|---|"]
    lines += [f"| {k} | {c} | {v} |" for (k, c), v in sorted(kinds.items())]
    refusals = Counter(_reason(r["result"]["oneshot"]["message"]) for r in rows if r["class"] == "refused")
    lines += ["", "| refusal (oneshot) | recipes |", "|---|---|"]
    lines += [f"| {m.replace('|', '/')} | {n} |" for m, n in refusals.most_common()]
    lines += ["", "Crashes:", ""]
    for r in rows:
        if r["class"] in ("crashed", "timeout", "harness error"):
            res = r["result"]
            f = res.get("oneshot") if isinstance(res.get("oneshot"), dict) else res.get("harness_error", {})
            what = f"timeout {res['timeout']} s" if "timeout" in res else f"{f.get('exception')}: {f.get('message')}"
            lines.append(f"- `{r['source']}` ({res.get('family', '?')}): {what} at {f.get('raised_at', '')}")
    lines += ["", "Ran, reload differs:", ""]
    for r in rows:
        if r["class"] == "reload differs":
            res = r["result"]
            why = res["reload"]["exception"] + ": " + res["reload"]["message"] if "reload" in res else (
                f"max |logit diff| {res.get('reload_max_abs_logit_diff')}"
                + (f", with load_kv_cache_scales equal: {res['reload_equal_with_kv_scales']}"
                   if "reload_equal_with_kv_scales" in res else "")
            )
            lines.append(f"- `{r['source']}` ({res.get('family')}): {why}")
    lines += ["", "explain (no model) and oneshot (on the tiny model) disagree:", ""]
    for r in rows:
        res = r["result"]
        if r.get("kind") == "python model_free_ptq":  # no recipe to explain
            continue
        if "explain" in res and (res["explain"] == "ok") != (res.get("oneshot") == "ok"):
            e = res["explain"] if res["explain"] != "ok" else "ok"
            o = res["oneshot"] if res.get("oneshot") == "ok" else res["oneshot"]["message"]
            lines.append(f"- `{r['source']}`: explain {e if e == 'ok' else e['message']!r}; oneshot {o!r}")
    lines += ["", "Arguments not recorded as given in the saved recipe.yaml:", ""]
    for r in rows:
        for d in r["result"].get("recipe_diff", []):
            lines.append(f"- `{r['source']}`: {d}")
    notrun = Counter(r["note"][:110] for r in rows if r["class"] == "not run")
    lines += ["", "| not run (not literal / not a recipe) | recipes |", "|---|---|"]
    lines += [f"| {m.replace('|', '/')} | {n} |" for m, n in notrun.most_common()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="llm-compressor working tree or git directory")
    parser.add_argument("--rev", default="HEAD", help="revision of a git directory (default HEAD)")
    parser.add_argument("--out", type=Path, default=Path("recipe_corpus.json"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per recipe (default 120)")
    parser.add_argument("--only", default=None, help="run only the recipes whose source contains this")
    parser.add_argument("--list", action="store_true", help="list the corpus, run nothing")
    parser.add_argument("--start", type=int, default=0, help="run from this index of the corpus order (0-based)")
    parser.add_argument("--stop", type=int, default=None, help="run up to (excluding) this index")
    parser.add_argument("--report", action="store_true", help="print the summary of the --out results, run nothing")
    parser.add_argument("--from-directory", action="store_true",
                        help="give oneshot the tiny model as a saved directory (the meta-device checks' path)")
    parser.add_argument("--rerun", type=Path, default=None,
                        help="a results file: run only its recipes not recorded as 'reload equal' or 'not run', and "
                        "write it to --out with their rows replaced")
    parser.add_argument("--refamily", action="store_true",
                        help="with --rerun: run instead the recipes whose tiny family differs from the one recorded "
                        "(after families were added to tests/tiny_families.py)")
    args = parser.parse_args(argv)
    global FROM_DIRECTORY
    FROM_DIRECTORY = args.from_directory  # read by run_entry in the forked processes
    if args.report:
        saved = json.loads(args.out.read_text())
        other = [Entry(**e) for e in saved["other"]]
        print(markdown(saved["rows"], other, Checkout(args.checkout, args.rev).revision()))
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    checkout = Checkout(args.checkout, args.rev)
    entries, other = corpus(checkout)
    if args.only:
        entries = [e for e in entries if args.only in e.source]
    previous = json.loads(args.rerun.read_text())["rows"] if args.rerun else None
    if previous is not None and args.refamily:
        recorded = {r["source"]: r["result"].get("family") for r in previous if r["class"] != "not run"}
        entries = [e for e in entries if e.source in recorded and family_of(e.models)[0] != recorded[e.source]]
    elif previous is not None:
        again = {r["source"] for r in previous if r["class"] not in ("reload equal", "not run")}
        entries = [e for e in entries if e.source in again]
    entries.sort(key=lambda e: "AutoRoundModifier" in e.modifiers)  # the slow ones last (stable otherwise)
    if args.list:
        for e in entries:
            print(f"{e.kind:15} {e.source:90} {','.join(e.modifiers) or '-':40} {e.models} {e.note}")
        for e in other:
            print(f"{'(none)':15} {e.source:90} {e.note}")
        return 0
    import torch  # noqa: F401 -- imported once here, so that every forked run starts with it
    import transformers  # noqa: F401

    import llmc_fsm  # noqa: F401

    ours = our_revision()
    rows = []
    for i, entry in enumerate(entries):
        if i < args.start or (args.stop is not None and i >= args.stop):
            continue
        if entry.recipe is None:
            rows.append({**asdict(entry), "class": "not run", "result": {}})
            continue
        result = run_forked(entry, args.timeout)
        row = {**asdict(entry), "class": classify(result), "result": result}
        rows.append(row)
        print(f"[{i + 1}/{len(entries)}] {row['class']:14} {result.get('wall_s')}s {entry.source}", file=sys.stderr)
        _write(args.out, ours, rows, other)
    if previous is not None:
        new = {r["source"]: r for r in rows}
        rows = [new.get(r["source"], r) for r in previous]
    _write(args.out, ours, rows, other)
    print(markdown(rows, other, checkout.revision()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
