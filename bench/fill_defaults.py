"""Bulk fills in bench/ write rows with INSERT ... SELECT generate_series, naming the columns they know. Columns
added to the models later (NOT NULL, with a default only on the Django side) would make those INSERTs fail, so
before a fill every such column of the throwaway database gets a database default of its type's zero value."""

from __future__ import annotations

ZERO = {
    "text": "''",
    "character varying": "''",
    "integer": "0",
    "bigint": "0",
    "smallint": "0",
    "numeric": "0",
    "double precision": "0",
    "real": "0",
    "boolean": "false",
    "jsonb": "'{}'::jsonb",
    "json": "'{}'::json",
    "timestamp with time zone": "now()",
    "date": "current_date",
    "uuid": "gen_random_uuid()",
}


def default_missing(cursor, table: str) -> list[str]:
    """Give every NOT NULL column of `table` without a database default its type's zero; returns their names."""
    cursor.execute(
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = %s AND is_nullable = 'NO' AND column_default IS NULL"
        " AND is_identity = 'NO' AND is_generated = 'NEVER'",
        [table],
    )
    changed = []
    for column, data_type in cursor.fetchall():
        if data_type in ZERO:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" SET DEFAULT {ZERO[data_type]}')
            changed.append(column)
    return changed
