"""What the job asks for: the spec (pydantic, parsed once at the edge, free of torch), its files
and overrides, its reference table, and the plain settings built from it for the components
below initialize."""
