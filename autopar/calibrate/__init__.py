"""`autopar calibrate`: measure a cluster under torchrun and fit a hardware profile to it."""
