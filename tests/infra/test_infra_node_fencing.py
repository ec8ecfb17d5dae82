"""The hung-node marker's right to fence a GPU node (infra/node_fencing.py): stop instances of this cluster's
GPU node group, read instance states, nothing else."""
from __future__ import annotations

from infra.config import HUNG_NODE_MARKER_SERVICE_ACCOUNT, NAMESPACE
from infra.node_fencing import FENCE_TAG


def test_the_marker_may_stop_only_the_gpu_instances_of_this_cluster_and_read_instance_states(full):
    [cluster_id] = full.resources("Cluster", "AWS::EKS::Cluster")
    [association] = [a["Properties"] for a in full.resources("Cluster", "AWS::EKS::PodIdentityAssociation").values()
                     if a["Properties"]["ServiceAccount"] == HUNG_NODE_MARKER_SERVICE_ACCOUNT]
    assert association["Namespace"] == NAMESPACE and association["ClusterName"] == {"Ref": cluster_id}
    role_id = association["RoleArn"]["Fn::GetAtt"][0]
    [policy] = [p["Properties"] for p in full.resources("Cluster", "AWS::IAM::Policy").values()
                if {"Ref": role_id} in p["Properties"]["Roles"]]
    statements = {s["Action"]: s for s in policy["PolicyDocument"]["Statement"]}
    assert sorted(statements) == ["ec2:DescribeInstances", "ec2:StopInstances"]
    assert statements["ec2:DescribeInstances"]["Resource"] == "*"
    stop = statements["ec2:StopInstances"]
    assert stop["Condition"] == {"StringEquals": {f"aws:ResourceTag/{FENCE_TAG}": {"Ref": cluster_id}}}
    assert stop["Resource"]["Fn::Join"][1][-1].endswith(":instance/*")
    # The GPU instances carry the tag with that value; the system nodes (which run the marker) do not.
    templates = [t["Properties"]["LaunchTemplateData"]
                 for t in full.resources("Cluster", "AWS::EC2::LaunchTemplate").values()]
    [gpu] = [t for t in templates if "NetworkInterfaces" in t]
    assert gpu["TagSpecifications"] == [
        {"ResourceType": "instance", "Tags": [{"Key": FENCE_TAG, "Value": {"Ref": cluster_id}}]}]
    others = [t for t in templates if "NetworkInterfaces" not in t]
    assert others and not any("TagSpecifications" in t for t in others)
