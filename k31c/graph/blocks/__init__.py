"""The model's blocks in plain PyTorch (spec/model.md), named as in the HF K3 checkpoint."""
