# The binary worker of tests/e2e/test_orphans.py: a shell that starts `sleep 300` in its session,
# reports {"worker": its pid, "children": [the sleep's pid]} to $OUT_DIR/$RANK.json, and waits.
sleep 300 &
child=$!
printf '{"worker": %d, "children": [%d]}' $$ "$child" > "$OUT_DIR/$RANK.json.tmp"
mv "$OUT_DIR/$RANK.json.tmp" "$OUT_DIR/$RANK.json"
wait
