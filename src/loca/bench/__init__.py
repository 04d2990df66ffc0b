"""Time and memory measurement (``measure``) and the phases ``loca bench`` times (``phases``)."""
