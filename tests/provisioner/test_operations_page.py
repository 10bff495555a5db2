"""The operations page's fleet figures: healthy whole GPUs on active nodes, in queries that do not grow
with the fleet."""

from django.test import Client

from provisioner.models import Device, Node
from tests.provisioner.conftest import gpu, make_node, make_user


def test_effective_compute_counts_healthy_whole_gpus_on_active_nodes(catalog):
    make_node("a", gpus=[gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1"), gpu(2, "GPU-a-2")])
    cordoned, _ = make_node("b", gpus=[gpu(0, "GPU-b-0")])
    Node.objects.filter(pk=cordoned.pk).update(state=Node.State.CORDONED)
    Device.objects.filter(uuid="GPU-a-0").update(last_metrics={"gpu_util_percent": 50})
    Device.objects.filter(uuid="GPU-a-1").update(last_metrics={"gpu_util_percent": 100})
    Device.objects.filter(uuid="GPU-a-2").update(
        health=Device.Health.LOST, last_metrics={"gpu_util_percent": 90}
    )
    client = Client()
    client.force_login(make_user("ops", staff=True))
    page = client.get("/operations/").content.decode()
    # two A100s of 312 TFLOPS count: u = (0.5 + 1.0) / 2
    assert 'data-testid="q">468.0 TFLOPS<' in page
    assert "2 GPUs, 624 TFLOPS peak, u = 0.75" in page
