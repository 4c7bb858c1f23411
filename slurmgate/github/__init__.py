"""GitHub: the scope, the REST client, the fleet snapshot, and the webhook relay."""
