namespace tokenlake {}
