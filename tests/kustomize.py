"""A small kustomize for the tests: renders deploy/k8s's kustomizations in Python.

No maintained Python implementation of kustomize exists (the `kustomize` package on PyPI is an
unrelated DSL), and CI machines need not have `kubectl`. This renders the subset deploy/k8s uses,
following kustomize's documented semantics:

- `resources` (files, or folders holding a kustomization), rendered depth first;
- `namespace` (set on every namespaced object);
- `labels` with `includeSelectors: false` (added to `metadata.labels` only);
- `images` (`name` -> `newName:newTag`, on containers);
- `patches` by `path`, strategic merge: maps merge; the lists Kubernetes merges by key are merged by
  that key (`STRATEGIC_LIST_KEYS`), other lists replace; `$patch: delete` removes the object; a
  patch applies to its `target` (kind and a `key=value` label selector) or else to the object of
  its own kind and name;
- `configMapGenerator` from `files`, with `options.labels` and `disableNameSuffixHash`.

Anything else raises `NotImplementedError`, so a manifest cannot silently use a feature this does
not render. Where `kubectl` is installed, tests/test_deploy.py also renders with
`kubectl kustomize` and requires both to agree.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

STRATEGIC_LIST_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
                       "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches",
             "configMapGenerator"}


def load_objects(path: Path) -> list[Obj]:
    """Every YAML document of a manifest file, skipping empty ones."""
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def render(folder: Path) -> list[Obj]:
    """The objects `kustomize build folder` would emit (in no particular order).

    Raises:
        NotImplementedError: the kustomization uses a field this module does not render.
        ValueError: a patch matches no object.
    """
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise NotImplementedError(f"{folder}: kustomization fields {sorted(unknown)}")
    objs: list[Obj] = []
    for res in k.get("resources", []):
        p = folder / res
        objs += render(p) if p.is_dir() else load_objects(p)
    for gen in k.get("configMapGenerator", []):
        objs.append(_config_map(folder, gen))
    for patch in k.get("patches", []):
        objs = _apply_patch(objs, folder, patch)
    for img in k.get("images", []):
        for o in objs:
            for c in _containers(o):
                if c.get("image", "").split(":")[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        if entry.get("includeSelectors", False) or entry.get("includeTemplates", False):
            raise NotImplementedError("labels with includeSelectors or includeTemplates")
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objs


def _config_map(folder: Path, gen: Obj) -> Obj:
    opts = gen.get("options", {})
    if not opts.get("disableNameSuffixHash"):
        raise NotImplementedError("configMapGenerator with a name hash")
    data = {Path(f).name: (folder / f).read_text() for f in gen.get("files", [])}
    meta: Obj = {"name": gen["name"]}
    if opts.get("labels"):
        meta["labels"] = dict(opts["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _containers(o: Obj) -> list[Obj]:
    spec = o.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def _matches(o: Obj, target: Obj) -> bool:
    if "kind" in target and o["kind"] != target["kind"]:
        return False
    if "name" in target and o["metadata"]["name"] != target["name"]:
        return False
    for term in filter(None, target.get("labelSelector", "").split(",")):
        key, value = term.split("=")
        if o["metadata"].get("labels", {}).get(key) != value:
            return False
    return True


def _apply_patch(objs: list[Obj], folder: Path, entry: Obj) -> list[Obj]:
    (patch,) = load_objects(folder / entry["path"])
    target = entry.get("target") or {"kind": patch["kind"], "name": patch["metadata"]["name"]}
    hits = [o for o in objs if _matches(o, target)]
    if not hits:
        raise ValueError(f"patch {entry['path']} matches nothing")
    if patch.get("$patch") == "delete":
        return [o for o in objs if not any(o is h for h in hits)]
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
    for o in hits:
        merged = strategic_merge(o, body)
        o.clear()
        o.update(merged)
    return objs


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """Merge `patch` into a copy of `base` (Kubernetes strategic merge, as described above)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = strategic_merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in STRATEGIC_LIST_KEYS:
        key = STRATEGIC_LIST_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            same = [i for i, b in enumerate(out) if b.get(key) == item.get(key)]
            if same:
                out[same[0]] = strategic_merge(out[same[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)
