"""The one place that names compute capabilities and GPU models (kernels/variants.py)."""

from sage_qual.kernels.variants import capability_label, gpu_label


def test_capability_label_joins_major_and_minor():
    assert capability_label((9, 0)) == "sm_90"
    assert capability_label([12, 1]) == "sm_121"  # read back from JSON as a list


def test_gpu_label_names_model_and_capability():
    assert gpu_label("NVIDIA H200", (9, 0)) == "NVIDIA H200 (sm_90)"
