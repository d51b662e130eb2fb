"""Built-in and file cases: what a case describes, how it is read, its layers."""
