"""srt-slurm recipes as InferenceX checks them in: bounded reading, schema 1 and 2, migration.

A recipe is hostile input: it is read with a size bound and `yaml.safe_load`, must be a
mapping no deeper than `MAX_DEPTH`, and every error names the key and the fix. Schema 1 keeps
each role's topology in `resources.<role>_nodes/_workers`, `gpus_per_<role>`,
`backend.<mode>_environment` and `backend.<engine>_config.<mode>`; schema 2 (srt-slurm 2.0,
`schema: 2`) groups it per role under `roles.{prefill,decode,agg}` with `nodes`, `workers`,
`gpus`, `env`, `args`, `extra_args`, names the engine in a top-level `engine:`, and places the
frontend, the benchmark client and the infra with `placement.node`. `expanded` turns a schema-2
recipe into the schema-1 layout (what srt-slurm's `expand_roles` / `expand_engine` /
`expand_placement` do before its schema loads), and `to_schema2` is the inverse for a schema-1
recipe (srt-slurm's `roles_from_legacy` plus the `engine:` and `placement:` moves of
`srtctl migrate`), so both forms read the same. Pure apart from reading the file.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurmgate.documents import DocumentError, parse_yaml
from slurmgate.errors import InputError

MAX_RECIPE_BYTES = 256 * 1024
MAX_DEPTH = 24
SCHEMAS = (1, 2)
ROLE_NAMES = ("prefill", "decode", "agg")
ROLE_TO_MODE = {"prefill": "prefill", "decode": "decode", "agg": "aggregated"}
ENGINE_CONFIG_KEY = {
    "sglang": "sglang_config",
    "vllm": "vllm_config",
    "trtllm": "trtllm_config",
    "mocker": "mocker_config",
}
ROLE_KEYS = ("nodes", "workers", "gpus", "env", "args", "extra_args", "critical", "kv_events")
# srt-slurm 2.0 renamed the SGLang router `sglang-router` and gave `sglang` to one router-free
# aggregated worker (the engine's own server, as `vllm`), which schema 1 has no name for: the
# schema-1 layout `expanded` returns calls that one this.
SGLANG_SERVER = "sglang-server"
FRONTEND_TO_SCHEMA1 = {"sglang-router": "sglang", "sglang": SGLANG_SERVER}
FRONTEND_TO_SCHEMA2 = {"sglang": "sglang-router", SGLANG_SERVER: "sglang"}
COLOCATE = "colocate"  # roles.decode.nodes: share the prefill nodes (schema 1: decode_nodes 0)
# placement.node per block, as schema-1 fields (srt-slurm core/placement.py)
_PLACEMENT = {
    "frontend": ("orchestrator_placement", "dedicated_node"),
    "benchmark": ("client_placement", "client_dedicated_node"),
}


class RecipeError(InputError):
    """A recipe that cannot be read; the message names the key and the fix."""


def load(path: str | Path) -> dict[str, Any]:
    """Read one recipe file: bounded in size and depth, YAML's safe subset, a mapping."""
    p = Path(path)
    try:
        with p.open("rb") as handle:
            raw = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read: {exc.strerror} — check the path") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"{p}: larger than {MAX_RECIPE_BYTES // 1024} KiB — a recipe is a short YAML file"
        )
    return parse(raw.decode("utf-8", errors="replace"), str(p))


def parse(text: str, source: str = "recipe") -> dict[str, Any]:
    """Parse recipe text (bounded as `load` bounds a file)."""
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: larger than {MAX_RECIPE_BYTES // 1024} KiB")
    try:
        data = parse_yaml(text, source, max_bytes=MAX_RECIPE_BYTES)
    except DocumentError as exc:
        raise RecipeError(f"{exc.source}: {exc.problem} — {exc.fix}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: not a mapping of recipe keys — a recipe is a YAML mapping")
    if _depth(data) > MAX_DEPTH:
        raise RecipeError(f"{source}: nests deeper than {MAX_DEPTH} levels — flatten it")
    if any(not isinstance(k, str) for k in data):
        raise RecipeError(f"{source}: a top-level key is not a string — quote it")
    schema(data, source)
    return data


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def schema(data: Mapping[str, Any], source: str = "recipe") -> int:
    """The recipe's schema: its `schema:` key (srt-slurm 2.0), else 1."""
    version = data.get("schema", 1)
    if isinstance(version, bool) or version not in SCHEMAS:
        raise RecipeError(
            f"{source}: schema: {version!r} is not a recipe schema slurmgate reads — use 1 or 2"
        )
    return int(version)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: not a mapping — write it as KEY: VALUE lines")
    return value


def backend_type(data: Mapping[str, Any]) -> str:
    """The engine of a schema-1 layout (`backend.type`, srt-slurm's default sglang)."""
    backend = data.get("backend")
    kind = backend.get("type", "sglang") if isinstance(backend, dict) else "sglang"
    if not isinstance(kind, str):
        raise RecipeError(
            f"backend.type: {kind!r} is not an engine name — use sglang, vllm or trtllm"
        )
    return kind


def expanded(data: Mapping[str, Any], source: str = "recipe") -> dict[str, Any]:
    """The recipe in the schema-1 layout (a copy): a schema-2 recipe's `engine:`, `roles:` and
    `placement:` become the fields they stand for; a schema-1 recipe comes back as it is."""
    out = copy.deepcopy(dict(data))
    if schema(out, source) == 1:
        out.pop("schema", None)
        return out
    out.pop("schema")
    _expand_engine(out)
    _expand_roles(out)
    _expand_placement(out)
    _rename_frontend(out, FRONTEND_TO_SCHEMA1)
    return out


def _rename_frontend(out: dict[str, Any], names: Mapping[str, str]) -> None:
    frontend = out.get("frontend")
    if isinstance(frontend, dict) and isinstance(frontend.get("type"), str):
        frontend["type"] = names.get(frontend["type"], frontend["type"])


def _expand_engine(out: dict[str, Any]) -> None:
    engine = out.pop("engine", None)
    if engine is None:
        return
    spec = {"type": engine} if isinstance(engine, str) else _mapping(engine, "engine")
    backend = out.setdefault("backend", {})
    _mapping(backend, "backend")
    for key, value in spec.items():
        if key in backend and backend[key] != value:
            raise RecipeError(f"engine.{key}: disagrees with backend.{key} — set it in one place")
        backend[key] = value


def _expand_roles(out: dict[str, Any]) -> None:
    roles = out.pop("roles", None)
    if roles is None:
        return
    roles = _mapping(roles, "roles")
    resources = _mapping(out.setdefault("resources", {}), "resources")
    backend = _mapping(out.setdefault("backend", {}), "backend")
    engine_key = ENGINE_CONFIG_KEY.get(backend_type(out), "sglang_config")
    legacy = [
        f"resources.{key}"
        for role in ROLE_NAMES
        for key in (f"{role}_nodes", f"{role}_workers", f"gpus_per_{role}")
        if key in resources
    ] + [
        f"backend.{key}"
        for mode in ROLE_TO_MODE.values()
        for key in (f"{mode}_environment", f"{mode}_extra_args")
        if key in backend
    ]
    legacy += [f"backend.{k}" for k in ENGINE_CONFIG_KEY.values() if backend.get(k)]
    if legacy:
        raise RecipeError(
            "roles: cannot be combined with the fields it stands for ("
            + ", ".join(sorted(legacy))
            + ") — use roles: or the schema-1 fields, not both"
        )
    for name, role in roles.items():
        if name not in ROLE_TO_MODE:
            raise RecipeError(f"roles.{name}: unknown role — use prefill, decode or agg")
        role = _mapping(role, f"roles.{name}")
        unknown = sorted(set(role) - set(ROLE_KEYS))
        if unknown:
            raise RecipeError(
                f"roles.{name}: unknown keys {', '.join(unknown)} — use " + ", ".join(ROLE_KEYS)
            )
        mode = ROLE_TO_MODE[name]
        if "nodes" in role:
            resources[f"{name}_nodes"] = _role_nodes(name, role["nodes"])
        if "workers" in role:
            resources[f"{name}_workers"] = role["workers"]
        if "gpus" in role:
            resources[f"gpus_per_{name}"] = role["gpus"]
        if "critical" in role:
            resources[f"{name}_critical"] = role["critical"]
        if "env" in role:
            backend[f"{mode}_environment"] = role["env"]
        if "args" in role:
            backend.setdefault(engine_key, {})[mode] = _mapping(role["args"], f"roles.{name}.args")
        if "extra_args" in role:
            backend[f"{mode}_extra_args"] = role["extra_args"]
        if "kv_events" in role:
            backend.setdefault("kv_events_config", {})[mode] = role["kv_events"]


def _role_nodes(name: str, value: Any) -> int:
    if value == COLOCATE and name == "decode":
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fix = "a positive integer" + (" or colocate" if name == "decode" else "")
        raise RecipeError(f"roles.{name}.nodes: {value!r} is not a node count — write {fix}")
    return value


def _expand_placement(out: dict[str, Any]) -> None:
    for block, (place, dedicated) in _PLACEMENT.items():
        section = out.get(block)
        if not isinstance(section, dict) or "placement" not in section:
            continue
        node = _mapping(section.pop("placement"), f"{block}.placement").get("node")
        if node == "dedicated":
            section[dedicated], section[place] = True, "head"
        elif isinstance(node, str):
            section[place] = node
        else:
            raise RecipeError(f"{block}.placement.node: {node!r} — write head, dedicated, …")
    infra = out.get("infra")
    if isinstance(infra, dict) and "placement" in infra:
        node = _mapping(infra.pop("placement"), "infra.placement").get("node")
        if node not in ("head", "dedicated"):
            raise RecipeError(f"infra.placement.node: {node!r} — write head or dedicated")
        infra["etcd_nats_dedicated_node"] = node == "dedicated"


def to_schema2(data: Mapping[str, Any], source: str = "recipe") -> dict[str, Any]:
    """A schema-1 recipe in schema 2 (a copy): its role fields folded into `roles:`, the engine
    to a top-level `engine:`, the placement knobs into `placement.node`, and `schema: 2` first.
    Reading the result with `expanded` gives back the recipe's own layout."""
    if schema(data, source) == 2:
        return copy.deepcopy(dict(data))
    legacy = copy.deepcopy(dict(data))
    legacy.pop("schema", None)
    resources = _mapping(legacy.get("resources"), "resources")
    backend = _mapping(legacy.get("backend"), "backend")
    engine_key = ENGINE_CONFIG_KEY.get(backend_type(legacy), "sglang_config")
    engine_cfg = _mapping(backend.get(engine_key), f"backend.{engine_key}")
    roles: dict[str, dict[str, Any]] = {}
    for name in ROLE_NAMES:
        mode = ROLE_TO_MODE[name]
        role: dict[str, Any] = {}
        if f"{name}_nodes" in resources:
            nodes = resources.pop(f"{name}_nodes")
            role["nodes"] = COLOCATE if name == "decode" and nodes == 0 else nodes
        for key, field in ((f"{name}_workers", "workers"), (f"gpus_per_{name}", "gpus")):
            if key in resources:
                role[field] = resources.pop(key)
        if f"{name}_critical" in resources:
            role["critical"] = resources.pop(f"{name}_critical")
        for key, field in ((f"{mode}_environment", "env"), (f"{mode}_extra_args", "extra_args")):
            value = backend.pop(key, None)
            if value:
                role[field] = value
        if engine_cfg.get(mode):
            role["args"] = engine_cfg.pop(mode)
        else:
            engine_cfg.pop(mode, None)
        if role:
            roles[name] = role
    kv_events = backend.get("kv_events_config")
    if isinstance(kv_events, dict):
        for name in ROLE_NAMES:
            if ROLE_TO_MODE[name] in kv_events and name in roles:
                roles[name]["kv_events"] = kv_events.pop(ROLE_TO_MODE[name])
        if not kv_events:
            backend.pop("kv_events_config")
    if engine_key in backend and not engine_cfg:
        backend.pop(engine_key)
    out: dict[str, Any] = {"schema": 2}
    for key, value in legacy.items():
        if key == "backend":
            kind = backend.pop("type", None)
            if backend:
                out["engine"] = {"type": kind, **backend} if kind else dict(backend)
            elif kind is not None:
                out["engine"] = kind
        elif key == "resources":
            if resources:
                out["resources"] = resources
            out["roles"] = roles
        else:
            out[key] = value
    for block, (place, dedicated) in _PLACEMENT.items():
        section = out.get(block)
        if isinstance(section, dict) and (place in section or dedicated in section):
            is_dedicated = section.pop(dedicated, False)
            where = section.pop(place, "head")
            section["placement"] = {"node": "dedicated" if is_dedicated else where}
    infra = out.get("infra")
    if isinstance(infra, dict) and "etcd_nats_dedicated_node" in infra:
        dedicated_infra = infra.pop("etcd_nats_dedicated_node")
        infra["placement"] = {"node": "dedicated" if dedicated_infra else "head"}
    _rename_frontend(out, FRONTEND_TO_SCHEMA2)
    return out


def role_nodes(data: Mapping[str, Any], source: str = "recipe") -> dict[str, int] | None:
    """The nodes each role's workers reserve, read from either schema; None: the recipe gives
    no node counts. A recipe gives agg_nodes, or both prefill_nodes and decode_nodes."""
    resources = _mapping(expanded(data, source).get("resources"), "resources")
    if resources.get("agg_nodes") is not None:
        return {"agg": resources["agg_nodes"]}
    counts = {r: resources.get(f"{r}_nodes") for r in ("prefill", "decode")}
    if all(v is None for v in counts.values()):
        return None
    return {role: value for role, value in counts.items() if value is not None}
