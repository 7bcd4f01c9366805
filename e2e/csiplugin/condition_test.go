package main

import "testing"

func TestMatchCondition(t *testing.T) {
	rules := "# comment\nvol-a disk on fire\nb-name \"esc \\x1b[31m red\"\n"
	for _, tc := range []struct {
		id, name, msg string
		ok            bool
	}{
		{"vol-a1", "", "disk on fire", true},
		{"x", "b-name-1", "esc \x1b[31m red", true},
		{"x", "y", "", false},
	} {
		msg, ok, err := matchCondition(rules, tc.id, tc.name)
		if err != nil || ok != tc.ok || msg != tc.msg {
			t.Fatalf("matchCondition(%q, %q) = %q, %t, %v; want %q, %t", tc.id, tc.name, msg, ok, err, tc.msg, tc.ok)
		}
	}
	if _, _, err := matchCondition(`v "unterminated`, "v", ""); err == nil {
		t.Fatal("a bad literal must be an error")
	}
}
