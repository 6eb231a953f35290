"""Mixers: the half of a layer kind that reads other positions (models/family.Part), one file each."""
