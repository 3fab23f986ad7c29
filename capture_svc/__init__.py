"""The capture service: one packed base forward per cohort, one signed StateBlock per request."""
