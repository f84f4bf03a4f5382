"""Build every group of a BAGEL data config (``data/configs/*.yaml``) and write the matching ``data.yaml``."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from mmidx.ingest.driver import build_dataset
from mmidx.ingest.plan import BuildError, BuildOptions
from mmidx.ingest.report import BuildReport
from mmidx.io.storage import is_remote
from mmidx.sources import SourceOptions

GROUP_SOURCES = {"t2i_pretrain": "t2i", "unified_edit": "edit", "vlm_sft": "vlm"}
DATA_CONFIG_NAME = "data.yaml"


def _load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as stream:
            loaded = yaml.safe_load(stream)
    except OSError as error:
        raise BuildError(f"cannot read {path}: {error.strerror or error}") from error
    except yaml.YAMLError as error:  # its message names the line and column, over several lines: make it one
        raise BuildError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from error
    if not isinstance(loaded, dict):
        raise BuildError(f"{path}: expected a mapping at the top level")
    return loaded


def _group_builds(group: str, spec: dict[str, Any], info: dict[str, Any], info_folder: str, output_dir: str,
                  settings: dict[str, Any]) -> list[BuildOptions]:
    """The builds of one group of a BAGEL data config: one per dataset name, inputs from the dataset info."""
    from mmidx.sources.media import frame_sampler_options

    if group not in GROUP_SOURCES:
        raise BuildError(f"group {group!r}: mmidx builds the BAGEL groups {', '.join(GROUP_SOURCES)}")
    source = GROUP_SOURCES[group]
    builds = []
    for name in spec.get("dataset_names", []):
        entry = info.get(group, {}).get(name)
        if not isinstance(entry, dict) or "data_dir" not in entry:
            raise BuildError(f"the dataset info has no data_dir for {group}/{name}")
        where = {key: os.path.join(info_folder, entry[key]) for key in ("data_dir", "jsonl_path") if key in entry}
        options = settings["source_options"]
        if source == "vlm":
            if "jsonl_path" not in where:
                raise BuildError(f"the dataset info has no jsonl_path for {group}/{name}")
            options = frame_sampler_options(replace(options, image_root=where["data_dir"]),
                                            spec.get("frame_sampler_args", {}))
        inputs = (where["jsonl_path"],) if source == "vlm" else (where["data_dir"],)
        builds.append(BuildOptions(source, inputs, output=os.path.join(output_dir, group, name),
                                   **{**settings, "source_options": options}))
    return builds


def build_from_config(config: str | os.PathLike, dataset_info: str | os.PathLike, output_dir: str | os.PathLike,
                      *, tokenizer: str, source_options: SourceOptions | None = None, workers: int = 1,
                      max_skip_rate: float = 0.01, progress: bool = True, engine: str = "local",
                      ray_address: str | None = None, force: bool = False, layout: str = "auto") -> list[BuildReport]:
    """Build every (group, dataset name) of a BAGEL data YAML and write ``output_dir/data.yaml``.

    ``config`` has BAGEL's ``data/configs/*.yaml`` shape; ``dataset_info`` maps group → dataset name →
    ``data_dir`` (parquet folder, or image folder for ``vlm_sft``) and ``jsonl_path``, as BAGEL's
    ``DATASET_INFO`` (relative paths are relative to the info file). The other arguments apply to
    every build; a group's ``frame_sampler_args`` set how its video frames are sampled. Every file is
    built once; ``num_used_data``, ``shuffle_lines`` and ``shuffle_seed`` go to the data config and
    select samples when the pack index is built. Unknown group keys are refused before anything is
    built. The data config is written only when every build passed.
    """
    import yaml

    from mmidx.config import data_yaml_group

    output_dir = os.fspath(output_dir)
    if is_remote(output_dir):
        raise BuildError(f"{output_dir}: --config builds write their datasets and data.yaml to a local or shared "
                         "folder; build there and upload each dataset (mmidx build --source ... --output s3://...), "
                         "or train from the local folder")
    groups, info = _load_yaml(config), _load_yaml(dataset_info)
    if isinstance(groups.get("groups"), dict):  # mmidx's own data.yaml: its groups under one key, not at the top
        raise BuildError(f"{config} looks like an mmidx data config (its groups are under groups:, with the "
                         "datasets' prefixes); it is what a build writes and mmidx index reads. The BAGEL config to "
                         "build from has the groups at the top level (t2i_pretrain:, unified_edit:, vlm_sft:) with "
                         "dataset_names, as in BAGEL's data/configs/*.yaml (mmidx demo writes one: "
                         "mmidx-demo/bagel.yaml)")
    info_folder = os.path.dirname(os.path.abspath(dataset_info))
    settings = {"tokenizer": tokenizer, "source_options": source_options or SourceOptions(), "workers": workers,
                "max_skip_rate": max_skip_rate, "progress": progress, "engine": engine,
                "ray_address": ray_address, "force": force, "layout": layout}
    for group, spec in groups.items():
        data_yaml_group(group, spec or {}, [])  # refuses unknown keys before anything is built
    plans = {group: _group_builds(group, spec or {}, info, info_folder, output_dir, settings)
             for group, spec in groups.items()}
    reports = [build_dataset(options) for builds in plans.values() for options in builds]
    if all(report.ok for report in reports):
        data_config: dict[str, Any] = {"groups": {}}
        for group, builds in plans.items():
            data_config["groups"][group] = data_yaml_group(
                group, groups[group] or {}, [os.path.relpath(options.output, output_dir) for options in builds])
        temporary = Path(output_dir, DATA_CONFIG_NAME + ".partial")
        try:
            temporary.write_text(yaml.safe_dump(data_config, sort_keys=False))
            os.replace(temporary, Path(output_dir, DATA_CONFIG_NAME))
        finally:
            temporary.unlink(missing_ok=True)
    return reports
