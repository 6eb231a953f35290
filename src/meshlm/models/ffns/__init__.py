"""Feed-forwards: the per-position half of a layer kind (models/family.Part), one file each."""
