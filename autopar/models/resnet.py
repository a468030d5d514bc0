"""ResNet / Wide-ResNet with bottleneck blocks (the torchvision layout: ``layer1``..``layer4``
are ``nn.Sequential`` stages; a wide net doubles the bottleneck width)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

__all__ = ["ResNet", "ResNetConfig"]

_EXPANSION = 4


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    blocks: tuple[int, int, int, int] = (3, 4, 6, 3)
    width_per_group: int = 64
    num_classes: int = 1000
    channels: int = 3


class Bottleneck(nn.Module):
    def __init__(self, in_ch: int, planes: int, width: int, stride: int):
        super().__init__()
        out_ch = planes * _EXPANSION
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.config = cfg
        self.conv1 = nn.Conv2d(cfg.channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = 64
        for i, (count, planes) in enumerate(zip(cfg.blocks, (64, 128, 256, 512))):
            width = planes * cfg.width_per_group // 64
            stage = []
            for j in range(count):
                stage.append(Bottleneck(in_ch, planes, width, stride=2 if (j == 0 and i > 0) else 1))
                in_ch = planes * _EXPANSION
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, cfg.num_classes)

    def forward(self, images):
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))
