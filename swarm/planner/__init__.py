"""Pure, deterministic placement: peers + RTTs + model -> coordinator, ring order, layer blocks."""
