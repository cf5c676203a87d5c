"""Whole-process measurements, each figure a fresh process as users run them: the default against
the target alone (whole_process, whole_tables), resident services (resident), the prompt cache
(prompt_cache), structured output (structured), tool calls (tool_calling), two checkouts side by
side (checkout_ab) and a remote target behind a delaying relay (distributed)."""
