"""The example Ray cluster launcher config is valid for Ray's own schema and starts what the
README's multi-node section says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ray = pytest.importorskip("ray")

CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "ray-cluster.yaml"


def test_cluster_yaml_matches_rays_schema():
    config = yaml.safe_load(CONFIG.read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    assert config["provider"]["type"] == "local"
    assert any(".[cluster,serve,model]" in c for c in config["setup_commands"])
    assert not any("ray stop" in c for c in config["head_start_ray_commands"])
