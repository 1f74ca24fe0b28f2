"""``WeightAverage`` keeps the average Boltz's own EMA callback keeps, bit for bit."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from physicsnemo_foldcp.training import WeightAverage

ema_module = pytest.importorskip("boltz.model.optim.ema")


class Net(nn.Module):
    """Weights, a float buffer and an integer buffer (which the average leaves alone)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 3)
        self.norm = nn.BatchNorm1d(3)  # running statistics (float) and num_batches_tracked

    @property
    def device(self):  # what Boltz's callback reads of a LightningModule
        return self.layer.weight.device

    def forward(self, x):
        return self.norm(self.layer(x))


@pytest.mark.parametrize("decay", [0.999, 0.5])
def test_the_average_is_boltzs_after_every_step(decay):
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    boltz = ema_module.EMA(decay)
    trainer = SimpleNamespace(global_step=0)
    boltz.on_train_start(trainer, net)
    ours = WeightAverage(net, decay)
    for step in range(1, 6):
        optimizer.zero_grad()
        net(torch.randn(8, 5)).square().sum().backward()
        optimizer.step()
        trainer.global_step = step
        boltz.on_train_batch_end(trainer, net, None, None, step - 1)
        ours.update(net, step)
        ours.update(net, step)  # once per step, as the callback's step check
        theirs = boltz.state_dict()["ema_weights"]
        assert set(ours.weights) == set(theirs)
        for name, value in ours.weights.items():
            assert torch.equal(value, theirs[name]), (step, name)
    assert ours.step == 5
    current = net.state_dict()
    assert not torch.equal(ours.weights["layer.weight"], current["layer.weight"])
    assert torch.equal(ours.weights["norm.num_batches_tracked"], torch.tensor(0))


def test_a_decay_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="EMA decay must be in"):
        WeightAverage(Net(), 1.5)
