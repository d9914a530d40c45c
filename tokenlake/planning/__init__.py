"""Building the plans: dispatch of sub-batches to instances, page gathers, plans on the wire."""
