"""The models a run trains, built on the meta device from their shapes (training/contract/shapes.py)."""
