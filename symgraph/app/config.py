"""The merge configuration as the command line and YAML files give it: the one frozen, validated
:class:`~symgraph.merging.config.MergeConfig` (declared, with its rules, in
:mod:`symgraph.merging.config`) read from a YAML file and the command line's options over it
(:func:`merge_options`). Defaults and validation live in the schema only.

Every option is declared once, as a field of :class:`MergeConfig` (its description, what a
refusal says is expected, its metavar): the YAML keys, the ``symgraph merge`` flags
(:mod:`symgraph.app.options`), the defaults and the docs' table (``docs/options.md``) are
derived from that declaration. The alignment options a merge shares with :func:`symgraph.align`
(``refine``, ``sketch``, ``tol``, ``outputs``, ``fold_norms``, ``full_groups``) take their type,
range and default from :class:`~symgraph.alignment.options.AlignOptions`, so the two accept and
refuse the same values. A config is a mapping of those keys (all optional but
``models``; command-line values win), e.g.::

    models: [path_a, path_b]
    align: activations
    data: batches.safetensors
    out: merged

Relative paths are read relative to the config file. A mergekit config (``merge_method:
linear``, ``models: [{model: ..., parameters: {weight: ...}}]``) is read too
(:func:`~symgraph.app.mergekit_config.from_mergekit`).
"""
from __future__ import annotations

import os

from pydantic import ValidationError

from ..core.schema import error_key, quoted, refusal, refused, short_repr as _short
from ..errors import InputError
from ..merging.config import MAX_REFINE, MERGE_KEYS, MergeConfig, check
from .mergekit_config import from_mergekit
from .options import flag, given_options

#: The largest merge config read (a config is a few lines), and how deep its values may nest.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32

__all__ = ["MERGE_KEYS", "MAX_REFINE", "MergeConfig", "read_merge_config", "merge_options", "defaults", "to_yaml",
           "from_mergekit", "build_config", "check"]


class _Unreadable(Exception):
    """A config's YAML that the loader refuses to read on (an alias, nesting too deep, a key
    given twice): the reason, completed with the file's name by :func:`read_merge_config`."""


def _yaml_loader():
    """PyYAML's safe loader reading ``1e-3`` as a number, as YAML 1.2 does (PyYAML follows YAML
    1.1, whose floats need a dot: ``tol: 1e-3`` would be the string '1e-3'); bounded: an alias
    (``*name``, what a "billion laughs" file multiplies itself with) is refused, values nest at
    most :data:`MAX_CONFIG_DEPTH` deep, and a mapping may not give a key twice (YAML would keep
    the last silently)."""
    import re
    import yaml

    class Loader(yaml.SafeLoader):
        _depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                ev = self.peek_event()
                raise _Unreadable(f"uses a YAML alias (*{ev.anchor}, line {ev.start_mark.line + 1}); expected "
                                  "plain values: a merge config takes no anchors (&name) or aliases (*name)")
            self._depth += 1
            try:
                if self._depth > MAX_CONFIG_DEPTH:
                    mark = self.peek_event().start_mark
                    raise _Unreadable(f"nests values more than {MAX_CONFIG_DEPTH} deep (line {mark.line + 1}); "
                                      "expected a mapping of options, each a value or a list of values")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if (key.tag, key.value) in seen:
                        raise _Unreadable(f"gives the key {key.value[:80]!r} twice (line {key.start_mark.line + 1}); "
                                          "expected each key once")
                    seen.add((key.tag, key.value))
            return super().construct_mapping(node, deep)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader


def _is_path(spec: str, base: str) -> bool:
    """Whether a model ``spec`` in a config is a path (as
    :func:`symgraph.checkpoints.inputs.check_paths` tells them): starting with '.', '/' or '~',
    with more than one '/', or a name that exists beside the config; anything else is a demo
    name or hub id."""
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith("/")
            or os.path.exists(os.path.join(base, spec)))


def _read_yaml(path: str) -> dict:
    """The mapping a YAML merge config holds, read within its bounds (size, depth, no aliases),
    or one :class:`InputError` line."""
    import yaml
    keys = ", ".join(MERGE_KEYS)
    from ..core.files import check_input_file
    check_input_file(path, "merge config", f"a YAML file with keys {keys}")
    with open(os.path.expanduser(path), "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"merge config {path!r} is over {MAX_CONFIG_BYTES >> 20} MiB; expected a YAML file of "
                         f"a few lines (at most {MAX_CONFIG_BYTES >> 20} MiB) with keys {keys}")
    try:
        cfg = yaml.load(raw.decode("utf-8"), Loader=_yaml_loader())  # a SafeLoader subclass
    except _Unreadable as e:
        raise InputError(f"merge config {path!r} {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"merge config {path!r} is not valid YAML ({str(e).splitlines()[0][:200]}); expected a "
                         f"mapping with keys {keys}") from None
    except (ValueError, OverflowError, RecursionError) as e:  # a value YAML parses but Python cannot hold
        raise InputError(f"merge config {path!r} holds a value that cannot be read ({quoted(e, 160)}); "
                         f"expected a mapping with keys {keys}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"merge config {path!r} holds a {type(cfg).__name__}; expected a mapping with keys {keys}")
    return cfg


def read_merge_config(path: str) -> dict:
    """The options of a YAML merge config, validated; paths relative to the config file."""
    cfg = _read_yaml(path)
    listed = cfg.get("models")
    if "merge_method" in cfg or (isinstance(listed, list) and any(isinstance(m, dict) for m in listed)):
        cfg = from_mergekit(cfg, path)
    try:
        parsed = MergeConfig.model_validate(cfg, context={"fields_only": True})  # the rules between: once complete
    except ValidationError as e:
        raise InputError(_explain(path, cfg, e.errors()[0])) from None
    base = os.path.dirname(os.path.abspath(os.path.expanduser(path)))

    def resolve(p, what):
        """A path of the config, relative to the config file (never to the working directory)."""
        q = os.path.normpath(os.path.join(base, os.path.expanduser(p)))
        if not os.path.exists(q):
            rel = "" if os.path.isabs(os.path.expanduser(p)) else " (relative paths in a config are relative " \
                                                                 "to the config file)"
            want = "a save_pretrained directory, a demo name or a hub id" if what == "model" else "a data file"
            raise InputError(f"merge config {path!r}: {what} {_short(p)} does not exist: no {q!r}{rel}; expected "
                             f"{want}")
        return q

    def model(m):
        if _is_path(m, base):
            return resolve(m, "model")
        if os.path.exists(os.path.expanduser(m)):  # loading would take it from the working directory
            raise InputError(f"merge config {path!r}: model {_short(m)} is not beside the config (no "
                             f"{os.path.join(base, m)!r}) but names {os.path.abspath(m)!r} in the working directory; "
                             "relative paths in a config are relative to the config file; expected a path from the "
                             "config's directory, an absolute path, or a demo name or hub id that is no local path")
        return m  # a demo name or a hub id

    out = parsed.model_dump(exclude_unset=True)
    out["models"] = [model(m) for m in parsed.models]
    if parsed.out is not None:
        o = os.path.expanduser(parsed.out)
        out["out"] = o if os.path.isabs(o) else os.path.join(base, o)
    if parsed.data is not None:
        out["data"] = resolve(parsed.data, "data")
    if parsed.weights is not None:
        try:
            out["weights"] = [float(x) for x in parsed.weights]
        except OverflowError:
            raise InputError(f"merge config {path!r}: key 'weights' is {_short(parsed.weights)}, a number too large "
                             f"for a float; expected {MERGE_KEYS['weights']}") from None
    return out


def _explain(path, cfg, err) -> str:
    """One line for pydantic's first error, naming the key."""
    key = error_key(err)
    if err["type"] == "extra_forbidden":
        return f"merge config {path!r} has an unknown key {key!r}; expected only {', '.join(MERGE_KEYS)}"
    if err["type"] == "missing":
        return f"merge config {path!r} has no {key!r} key; expected {MERGE_KEYS[key]}"
    v = cfg.get(key)
    return refusal(err, f"merge config {path!r}: key {key!r} is {_short(v)} ({type(v).__name__})",
                   MERGE_KEYS.get(key, "a valid value"))


def build_config(fields: dict, *, batches: bool = False, name=None) -> MergeConfig:
    """A :class:`MergeConfig` of ``fields``, checked whole, or one :class:`InputError` line;
    ``batches``: the data come as batches already loaded (``run_merge(cfg, data=...)``), so
    the options that need data have it without ``data``; ``name(key)``: how a refusal names
    an option (default: its flag)."""
    name = name or (lambda k: flag(MergeConfig, k))
    try:
        return MergeConfig.model_validate(fields, context={"batches": batches, "name": name})
    except ValidationError as e:
        raise InputError(refused(e, fields, name, MergeConfig)) from None


def defaults() -> dict:
    """Every option's default, from the schema."""
    return {k: f.default for k, f in MergeConfig.model_fields.items() if k != "models"} | {"models": []}


def merge_options(args: dict) -> MergeConfig:
    """The merge job from the command line (``args``: argparse's namespace as a dict) over a
    ``config`` file's options; refuses missing or inconsistent ones."""
    opts = defaults()
    from_file: set = set()
    if args.get("config"):
        read = read_merge_config(args["config"])
        opts.update(read)
        from_file = {k for k in read if k != "models"}
    # command-line values override the config
    if args.get("models"):
        if args.get("config") and opts["models"]:
            raise InputError("models given both on the command line and in --config; expected one or the other")
        opts["models"] = list(args["models"])
    given = given_options(args, MergeConfig)  # the flags the command line set (the schema's fields)
    opts.update(given)
    from_file -= set(given)
    config = args.get("config")

    def where(k):
        return f"'{k}:' in {config}" if k in from_file else flag(MergeConfig, k)
    _job(opts)
    given_keys = {"models", *given, *from_file}  # the rest take the schema's defaults (align: refine's)
    return build_config({k: v for k, v in opts.items() if k in given_keys}, name=where)


def _job(opts: dict) -> None:
    """What every merge needs, asked for as the command line spells it: two models and an output."""
    if len(opts["models"]) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(opts['models'])}; expected "
                         "`symgraph merge A B [C ...] --out DIR` or `symgraph merge --config merge.yaml`")
    if not opts["out"]:
        raise InputError("merge needs an output directory; expected --out DIR (or 'out:' in the config)")


def to_yaml(cfg: MergeConfig, out: str = "merged") -> str:
    """The YAML config that reproduces ``cfg`` (options at their default left out)."""
    import yaml
    d = cfg.model_dump(exclude_defaults=True, exclude={"force", "out", "models"})
    head = {"models": list(cfg.models), "align": cfg.align, "method": cfg.method}
    return yaml.safe_dump({**head, **d, "out": out}, sort_keys=False, allow_unicode=True)


if __name__ == "__main__":  # python -m symgraph.app.config > docs/options.md
    from .options import options_page
    print(options_page(MergeConfig), end="")
