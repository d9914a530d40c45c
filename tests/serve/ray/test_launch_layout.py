"""The launch's layout (no Ray needed): flags and YAML files, validation naming the argument,
instance-to-node assignment and bundles, the command line's parser."""

from __future__ import annotations

import pytest

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.ray import cli as launch
from tokenlake.serve.ray.config import (
    LaunchLayout,
    layout_from,
    parse_nodes,
    read_layout_file,
)


def test_assignment_per_placement():
    assert LaunchLayout(4, placement="spread").assign(2) == [0, 1, 0, 1]
    assert LaunchLayout(4, placement="pack").assign(2) == [0, 0, 1, 1]
    assert LaunchLayout(3, placement="pack").assign(2) == [0, 0, 1]
    assert LaunchLayout(2, placement="pack").assign(3) == [0, 1]
    assert LaunchLayout(3, placement="strict-spread").assign(3) == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="strict-spread needs 3 nodes"):
        LaunchLayout(3, placement="strict-spread").assign(2)
    with pytest.raises(InvalidArgumentError, match="no node"):
        LaunchLayout(1).assign(0)


def test_bundles_one_per_gpu_or_one_cpu_bundle():
    assert LaunchLayout(2).bundles() == [{"CPU": 1.0}]
    assert LaunchLayout(2, cpus_per_instance=0.5).bundles() == [{"CPU": 0.5}]
    assert LaunchLayout(1, gpus_per_instance=2, cpus_per_instance=4).bundles() == [
        {"GPU": 1.0, "CPU": 2.0},
        {"GPU": 1.0, "CPU": 2.0},
    ]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_instances": 0}, "num_instances"),
        ({"num_instances": True}, "num_instances"),
        ({"num_instances": 2.0}, "num_instances"),
        ({"gpus_per_instance": -1}, "gpus_per_instance"),
        ({"cpus_per_instance": 0}, "cpus_per_instance"),
        ({"cpus_per_instance": float("nan")}, "cpus_per_instance"),
        ({"num_nodes": -1}, "num_nodes"),
        ({"placement": "random"}, "placement"),
        ({"node_resources": ("a b",)}, "node_resources"),
        ({"node_resources": ("a", "a")}, "node_resources"),
        ({"node_resources": ["a"]}, "node_resources"),
        ({"node_resources": ("a",), "num_nodes": 1}, "nodes"),
        ({"num_instances": 3, "num_nodes": 2, "placement": "strict-spread"}, "placement"),
    ],
)
def test_bad_layouts_name_the_argument(kwargs, name):
    with pytest.raises(InvalidArgumentError, match=f"^{name}"):
        LaunchLayout(**kwargs)


def test_nodes_flag_is_a_count_or_resource_names():
    assert parse_nodes("3") == (3, ())
    assert parse_nodes("node0, node1") == (0, ("node0", "node1"))
    for bad in ("", "a,,b", ","):
        with pytest.raises(InvalidArgumentError, match="nodes"):
            parse_nodes(bad)


def test_layout_file_and_flags(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text(
        "instances: 4\nnodes: [node0, node1]\nplacement: pack\ncpus_per_instance: 0.5\n"
    )
    values = read_layout_file(path)
    assert layout_from(values, {}) == LaunchLayout(
        4, cpus_per_instance=0.5, node_resources=("node0", "node1"), placement="pack"
    )
    # a flag wins, and a node count replaces the file's node list as a whole
    layout = layout_from(values, {"num_instances": 2, "num_nodes": 1})
    assert (layout.num_instances, layout.num_nodes, layout.node_resources) == (2, 1, ())
    path.write_text("instances: 2\nreplicas: 3\n")
    with pytest.raises(InvalidArgumentError, match=r"unknown keys \['replicas'\]"):
        read_layout_file(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(InvalidArgumentError, match="mapping"):
        read_layout_file(path)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        read_layout_file(tmp_path / "missing.yaml")


def test_parser_has_server_and_launch_options(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("instances: 3\nnodes: 2\n")
    args = launch.build_parser().parse_args(
        ["--layout", str(path), "--placement", "pack", "--model", "tiny-random", "--port", "0"]
    )
    layout = launch.layout_of(args)
    assert (layout.num_instances, layout.num_nodes, layout.placement) == (3, 2, "pack")
    assert (args.model, args.port, args.host, args.address) == ("tiny-random", 0, None, None)
    args = launch.build_parser().parse_args(["--num-instances", "5", "--nodes", "a,b"])
    assert launch.layout_of(args).node_resources == ("a", "b")
    assert "--force-cross-node" in launch.build_parser().format_help()
